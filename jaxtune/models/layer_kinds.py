"""Decoders whose layers are not all alike: one stack of layers per kind, run in the checkpoint's order.

A stack holds every layer of one kind with a leading layer axis, so each kind's layer body compiles once. The
model runs the layers as runs of consecutive layers of one kind, each run a loop over its part of its stack. A
model whose layers are all of the default kind has one stack, `layers`, and one run.
"""

from __future__ import annotations

import dataclasses
import functools

from jaxtune.models.config import ModelConfig

DEFAULT = "decoder"  # the family's own block (attention + its MLP or mixture of experts)
DENSE_MLP = "dense_mlp"  # a mixture-of-experts model's layer with a dense MLP (Qwen3-MoE's mlp_only_layers)
GATED_DELTANET = "gated_deltanet"  # a hybrid decoder's linear-attention layer (Qwen3.5's `linear_attention`)
SLIDING = "sliding_attention"  # a layer attending through the sliding window among full ones (gpt-oss)
# Gemma 4's last `num_kv_shared_layers` layers: no keys and values of their own, they attend to those of the last
# earlier layer of their type (sliding or full)
KV_SHARED_SLIDING = "kv_shared_sliding"
KV_SHARED_FULL = "kv_shared_full"


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The layers of one kind: the model attribute that holds them and their indices in the decoder, ascending."""

    attr: str
    kind: str
    layers: tuple[int, ...]

    def local(self, layer: int) -> int:
        """The position of decoder layer `layer` in this stack."""
        return self.layers.index(layer)


@dataclasses.dataclass(frozen=True)
class LayerRun:
    """Consecutive decoder layers [first, first + count) of one stack, at positions [start, start + count)."""

    stack: LayerStack
    start: int
    count: int
    first: int


def layer_kind(cfg: ModelConfig, layer: int) -> str:
    if cfg.num_kv_shared_layers and layer >= cfg.num_layers - cfg.num_kv_shared_layers:
        return KV_SHARED_SLIDING if cfg.layer_types[layer] == "sliding_attention" else KV_SHARED_FULL
    if cfg.layer_types and cfg.layer_types[layer] == "linear_attention":
        return GATED_DELTANET
    if cfg.layer_types and cfg.layer_types[layer] == "sliding_attention":
        return SLIDING
    return DENSE_MLP if layer in cfg.dense_mlp_layers else DEFAULT


def stack_attr(kind: str) -> str:
    return "layers" if kind == DEFAULT else f"{kind}_layers"


@functools.cache
def layer_stacks(cfg: ModelConfig) -> tuple[LayerStack, ...]:
    """The model's stacks, the default kind's (`layers`) first."""
    kinds: dict[str, list[int]] = {DEFAULT: []}
    for i in range(cfg.num_layers):
        kinds.setdefault(layer_kind(cfg, i), []).append(i)
    return tuple(LayerStack(stack_attr(kind), kind, tuple(layers)) for kind, layers in kinds.items() if layers)


@functools.cache
def layer_runs(cfg: ModelConfig) -> tuple[LayerRun, ...]:
    """The decoder's layers in order, as runs of one stack's consecutive layers."""
    where = {i: (s, s.local(i)) for s in layer_stacks(cfg) for i in s.layers}
    runs: list[LayerRun] = []
    for i in range(cfg.num_layers):
        stack, local = where[i]
        if runs and runs[-1].stack == stack and runs[-1].first + runs[-1].count == i:
            runs[-1] = dataclasses.replace(runs[-1], count=runs[-1].count + 1)
        else:
            runs.append(LayerRun(stack, local, 1, i))
    return tuple(runs)


def locate(cfg: ModelConfig, layer: int) -> tuple[LayerStack, int]:
    """(the stack holding decoder layer `layer`, its position there)."""
    for stack in layer_stacks(cfg):
        if layer in stack.layers:
            return stack, stack.local(layer)
    raise IndexError(f"layer {layer} is not one of the model's {cfg.num_layers}")


def sliding(kind: str) -> bool:
    """Whether a stack's layers attend through the sliding window among full ones."""
    return kind in (SLIDING, KV_SHARED_SLIDING)


def kv_shared(kind: str) -> bool:
    """Whether a stack's layers attend to an earlier layer's keys and values (Gemma 4's KV sharing)."""
    return kind in (KV_SHARED_SLIDING, KV_SHARED_FULL)


def attention_window(cfg: ModelConfig, kind: str) -> int | None:
    """The sliding window of a stack's attention: every layer's where the config names no sliding layers (Mistral,
    Mixtral), else only the sliding kinds'."""
    if cfg.layer_types and "sliding_attention" in cfg.layer_types:
        return cfg.sliding_window if sliding(kind) else None
    return cfg.sliding_window


def attention_geometry(cfg: ModelConfig, kind: str) -> tuple[int, int, bool]:
    """(head size, KV heads, whether the keys serve as values) of a stack's attention: the full-attention layers'
    own where the config gives them (Gemma 4), else the model's."""
    if cfg.full_head_dim and not sliding(kind):
        return cfg.full_head_dim, cfg.full_num_kv_heads or cfg.num_kv_heads, cfg.full_k_eq_v
    return cfg.head_dim, cfg.num_kv_heads, False


def full_rope(cfg: ModelConfig, kind: str) -> bool:
    """Whether a stack's layers use the full-attention layers' own RoPE (Gemma 4's proportional RoPE)."""
    return bool(cfg.full_head_dim) and not sliding(kind)


def kv_source(cfg: ModelConfig, layer: int) -> int:
    """The decoder layer whose keys and values layer `layer` attends to: itself, or for a KV-sharing layer the last
    earlier layer of its type that has its own."""
    if not kv_shared(layer_kind(cfg, layer)):
        return layer
    first = cfg.num_layers - cfg.num_kv_shared_layers
    return max(i for i in range(first) if cfg.layer_types[i] == cfg.layer_types[layer])


def holds_kv_cache(kind: str) -> bool:
    """Whether a stack's layers hold a KV cache: all but a hybrid decoder's linear-attention layers and the
    KV-sharing ones."""
    return kind != GATED_DELTANET and not kv_shared(kind)


def attention_position(cfg: ModelConfig, layer: int) -> int:
    """Decoder layer `layer`'s KV cache index among the layers that hold one (a KV-sharing layer's: its source's)."""
    return sum(holds_kv_cache(layer_kind(cfg, i)) for i in range(kv_source(cfg, layer)))


def runs_layer_by_layer(cfg: ModelConfig) -> bool:
    """Whether the model's layers run one by one (`models/layer_by_layer.py`): Gemma 4's per-layer inputs or KV
    sharing."""
    return bool(cfg.per_layer_dim or cfg.num_kv_shared_layers)


def has_experts(cfg: ModelConfig, stack: LayerStack) -> bool:
    """Whether the stack's layers route their MLP to experts."""
    return bool(cfg.num_experts) and stack.kind != DENSE_MLP


def sparse_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The decoder layers whose MLP routes to experts (those of the `layers` stack; exports that read the experts'
    adapters from that stack refuse a model whose other stacks have experts too)."""
    stacks = [s for s in layer_stacks(cfg) if has_experts(cfg, s)]
    return stacks[0].layers if len(stacks) == 1 else tuple(i for s in stacks for i in s.layers)
