"""A merged HF checkpoint: W + scale * B @ A for every adapted projection, loadable by transformers."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from convert.atomic import atomic_directory
from convert.jaxtune_format import write_generation_config
from convert.moe_names import (GEMMA4, expert_layout, fused_layout, fused_projections, fused_shape, join_fused,
                               split_fused, stores_fused)
from convert.safetensors_writer import ShardedSafetensorsWriter
from convert.safetensors_source import SafetensorsSource
from jaxtune.quant import nf4
from jaxtune.errors import CheckpointError
from jaxtune.models.causal_lm import CausalLM, Linear
from jaxtune.models.layer_kinds import has_experts, locate
from jaxtune.moe.experts import LoRAExperts, NF4Experts
from jaxtune.qlora import ALL_TARGETS, PARENT_MODULE, LoRALinear, NF4Linear, projection, projection_names

_DTYPES = {"bfloat16": jax.numpy.bfloat16, "float16": np.float16, "float32": np.float32}
MERGED_DTYPES = (*_DTYPES, "nf4")  # nf4: the projections re-quantized as bitsandbytes stores them, the rest bf16
BNB_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": "nf4",
              "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
              "llm_int8_skip_modules": ["lm_head"]}


def _layer(array: Any, i: int) -> np.ndarray:
    return np.asarray(array[i], np.float32)


def _base(proj):
    return proj.base if isinstance(proj, (LoRALinear, LoRAExperts)) else proj


def _base_weight(proj, i: int) -> np.ndarray:
    base = _base(proj)
    if isinstance(base, NF4Linear):
        return np.asarray(nf4.dequantize(jax.tree.map(lambda a: a[i], base.weight_nf4)), np.float32)
    if isinstance(base, Linear):
        return _layer(base.weight[...], i)
    raise TypeError(f"unexpected projection {type(base).__name__}")


def _with_expert_lora(w: np.ndarray, proj, i: int, e: int | None = None) -> np.ndarray:
    """Layer i's base experts w [E, out, in] (or expert e's [out, in]) plus their LoRA, where proj has one."""
    if not isinstance(proj, LoRAExperts):
        return w
    a, b = (np.asarray(f[...][i] if e is None else f[...][i, e], np.float32) for f in (proj.lora_a, proj.lora_b))
    return w + np.float32(proj.scale) * (b @ a)


def _weight_shape(proj) -> tuple[int, int]:
    base = _base(proj)
    codes = base.codes if isinstance(base, (NF4Linear, NF4Experts)) else None
    return (codes.shape[-2], codes.shape[-1] * 2) if codes is not None else tuple(base.weight.shape[-2:])


def _layer_experts(proj, i: int) -> np.ndarray:
    """Layer i's base experts [E, out, in] in float32 (NF4 dequantized)."""
    base = _base(proj)
    if isinstance(base, NF4Experts):
        q = nf4.NF4Weight(*(a[...][i] for a in (base.codes, base.absmax_codes, base.nested_absmax, base.offset,
                                                base.nested_map)), None)
        return np.asarray(nf4.dequantize(q), np.float32)
    return _layer(base.weight[...], i)


@dataclasses.dataclass(frozen=True)
class MergedTensor:
    """One HF-named tensor of the merged model: its shape now, its float32 values when `compute()` is called."""

    name: str
    shape: tuple[int, ...]
    compute: Callable[[], np.ndarray]


def merged_tensors(model: CausalLM, source: SafetensorsSource | None) -> Iterator[MergedTensor]:
    """The merged model's tensors in HF order, each computed only when asked: a writer can lay out every file
    first and then hold one tensor at a time."""
    cfg = model.config

    def whole(name: str, array: Any) -> MergedTensor:
        return MergedTensor(name, tuple(array.shape), functools.partial(np.asarray, array, np.float32))

    def layer(name: str, stack: Any, i: int) -> MergedTensor:
        return MergedTensor(name, tuple(stack.shape[1:]), functools.partial(_layer, stack, i))

    def merged_weight(key: str, proj, i: int) -> np.ndarray:
        w = np.asarray(source.get(key), np.float32) if source is not None else _base_weight(proj, i)
        if isinstance(proj, LoRALinear):
            a, b = _layer(proj.lora_a[...], i), _layer(proj.lora_b[...], i)
            w = w + np.float32(proj.scale) * (b @ a)
        return w

    dequantized: dict[tuple[str, str, int], np.ndarray] = {}  # the current layer's base experts, for its 3E tensors

    def merged_expert(key: str, name: str, attr: str, i: int, e: int) -> np.ndarray:
        proj = projection(model, name, attr)
        if source is not None:
            w = np.asarray(source.get(key), np.float32)
        else:
            if (name, attr, i) not in dequantized:
                if any((held_attr, held) != (attr, i) for _, held_attr, held in dequantized):
                    dequantized.clear()
                dequantized[(name, attr, i)] = _layer_experts(proj, i)
            w = dequantized[(name, attr, i)][e]
        return _with_expert_lora(w, proj, i, e)

    parent, hub_names = expert_layout(cfg.model_type) if cfg.num_experts else (None, {})
    expert_shapes = {name: _weight_shape(projection(model, name)) for name in hub_names}

    layout = fused_layout(cfg.model_type)

    def merged_fused(attr: str, key: str, i: int, bias: bool) -> np.ndarray:
        """A fused tensor (gpt-oss, Gemma 4) of layer i of stack `attr`: its projections' merged experts (the base's
        fused tensor read once and split, or the model's own dequantized weights), or their biases, joined again."""
        hub = key.rsplit(".", 1)[1].removesuffix("_bias")
        names = fused_projections(hub)
        module = getattr(getattr(model, attr), layout.module)
        if bias:
            parts = {n: _layer(_base(getattr(module, n)).bias[...], i) for n in names}
        else:
            base = (split_fused(hub, False, np.asarray(source.get(key), np.float32), layout) if source is not None
                    else {n: _layer_experts(getattr(module, n), i) for n in names})
            parts = {n: _with_expert_lora(base[n], getattr(module, n), i) for n in names}
        return join_fused(hub, bias, parts, layout)

    def fused_experts(p: str, attr: str, i: int) -> Iterator[MergedTensor]:
        """The fused layouts: gpt-oss's router with its bias and every expert in one tensor per projection, with
        biases; Gemma 4's scaled router beside the dense MLP, and its experts."""
        router = getattr(getattr(model, attr), layout.module).router
        e, width, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if layout == GEMMA4:
            yield layer(f"{p}.router.proj.weight", router.weight[...], i)
            yield layer(f"{p}.router.scale", router.scale[...], i)
            yield layer(f"{p}.router.per_expert_scale", router.per_expert_scale[...], i)
            prefix, biases = f"{p}.experts", (False,)
        else:
            yield layer(f"{p}.mlp.router.weight", router.weight[...], i)
            yield layer(f"{p}.mlp.router.bias", router.bias[...], i)
            prefix, biases = f"{p}.mlp.experts", (False, True)
        for hub in ("gate_up_proj", "down_proj"):
            for bias in biases:
                key = f"{prefix}.{hub}" + ("_bias" if bias else "")
                shape = fused_shape(hub, bias, e, hidden, width, layout)
                yield MergedTensor(key, shape, functools.partial(merged_fused, attr, key, i, bias))

    def experts(p: str, attr: str, i: int) -> Iterator[MergedTensor]:  # i: the layer's position in stack `attr`
        yield layer(f"{p}.{parent}.gate.weight", getattr(model, attr).mlp.router.weight[...], i)
        for e in range(cfg.num_experts):
            for name, hub_name in hub_names.items():
                key = f"{p}.{parent}.experts.{e}.{hub_name}.weight"
                yield MergedTensor(key, expert_shapes[name], functools.partial(merged_expert, key, name, attr, i, e))

    def norms(stack: Any) -> list[tuple[str, Any]]:
        """The layer's tensors beside its projections (norms; a Gated DeltaNet layer's conv, decay and norm)."""
        names = [(f"{norm}.weight", getattr(stack, norm).weight) for norm in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
            "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
            if hasattr(stack, norm)]  # Gemma 4 has the four around attention and the MLP, and three more with experts
        if hasattr(stack, "layer_scalar"):
            names.append(("layer_scalar", stack.layer_scalar))
        if getattr(stack, "per_layer_input_gate", None) is not None:  # Gemma 4's per-layer inputs (frozen)
            names += [(f"{name}.weight", getattr(stack, name).weight)
                      for name in ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")]
        if cfg.qk_norm and hasattr(stack, "self_attn"):
            names += [(f"self_attn.{norm}.weight", getattr(stack.self_attn, norm).weight) for norm in ("q_norm", "k_norm")
                      if getattr(stack.self_attn, norm) is not None]  # KV-sharing layers have no k_norm
        if getattr(getattr(stack, "self_attn", None), "sinks", None) is not None:
            names.append(("self_attn.sinks", stack.self_attn.sinks))
        if hasattr(stack, "linear_attn"):
            gdn = stack.linear_attn
            names += [("linear_attn.conv1d.weight", gdn.conv1d.weight), ("linear_attn.A_log", gdn.A_log),
                      ("linear_attn.dt_bias", gdn.dt_bias), ("linear_attn.norm.weight", gdn.norm.weight)]
        return names

    yield whole("model.embed_tokens.weight", model.embed_tokens.weight[...])
    if cfg.per_layer_dim:
        for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"):
            yield whole(f"model.{name}.weight", getattr(model, name).weight[...])
    for i in range(cfg.num_layers):
        kind, j = locate(cfg, i)  # the layer's stack and its position there
        stack, sparse = getattr(model, kind.attr), has_experts(cfg, kind)
        p = f"model.layers.{i}"
        for name, param in norms(stack):
            yield layer(f"{p}.{name}", param[...], j)
        if sparse and stores_fused(cfg.model_type):
            yield from fused_experts(p, kind.attr, j)
        elif sparse:
            yield from experts(p, kind.attr, j)
        shared = getattr(stack.mlp, "shared_expert", None) if sparse else None
        if shared is not None:  # Qwen3.5-MoE: a dense MLP beside the routed experts, and its sigmoid gate's weight
            for name in ("gate_proj", "up_proj", "down_proj"):
                proj, key = getattr(shared, name), f"{p}.mlp.shared_expert.{name}.weight"
                yield MergedTensor(key, _weight_shape(proj), functools.partial(merged_weight, key, proj, j))
            gate = stack.mlp.shared_expert_gate
            yield MergedTensor(f"{p}.mlp.shared_expert_gate.weight", _weight_shape(gate),
                               functools.partial(merged_weight, f"{p}.mlp.shared_expert_gate.weight", gate, j))
        for name in projection_names(stack):
            if sparse and PARENT_MODULE[name] == "mlp" and getattr(stack, "moe", None) is None:
                continue  # the MLP is the experts (Gemma 4's experts are beside a dense MLP)
            proj = projection(model, name, kind.attr)
            key = f"{p}.{PARENT_MODULE[name]}.{name}"
            yield MergedTensor(f"{key}.weight", _weight_shape(proj),
                               functools.partial(merged_weight, f"{key}.weight", proj, j))
            bias = _base(proj).bias
            if bias is not None:
                yield layer(f"{key}.bias", bias[...], j)
    yield whole("model.norm.weight", model.norm.weight[...])
    if model.lm_head is not None:
        yield whole("lm_head.weight", model.lm_head.weight[...])


def _is_projection_weight(name: str) -> bool:
    return name.startswith("model.layers.") and name.rsplit(".", 2)[-2] in ALL_TARGETS and name.endswith(".weight")


def _bnb_name(weight_name: str, suffix: str) -> str:
    """bnb's serialized name of one of an NF4 weight's tensors (`weight` itself, or `weight.absmax`, ...)."""
    return weight_name if suffix == "weight" else f"{weight_name}.{suffix}"


def open_original(model: CausalLM, base: str | os.PathLike | None):
    """A tensor source of the ORIGINAL weights `base` (HF directory or .gguf) checked against the model, or None.

    None (no base) warns when the adapters would be merged onto dequantized NF4 weights, which loses quality.
    """
    if base is None:
        if any(isinstance((p.base if isinstance(p, LoRALinear) else p), NF4Linear)
               for stack, layers in model.layer_stacks()
               for p in (projection(model, n, stack.attr) for n in projection_names(layers))):
            warnings.warn("merging onto dequantized NF4 weights loses quality; pass base=<HF dir or .gguf of the "
                          "original weights> (--base) to merge onto them", stacklevel=3)
        return None
    from convert.jaxtune_format import is_jaxtune_checkpoint
    from convert.load import bnb_quantization, open_checkpoint
    from jaxtune.io.bundled import resolve_model_path

    base = resolve_model_path(os.fspath(base))  # a bundled name or hub id: its local copy
    if os.path.isdir(base) and (is_jaxtune_checkpoint(base) or bnb_quantization(base)):
        raise CheckpointError(f"base {base} holds NF4-quantized weights; pass the HF directory (or .gguf) of the "
                              "original weights, or omit it to merge onto the dequantized weights")
    base_cfg, source, _ = open_checkpoint(base)
    # the architecture must match; where the eos ids came from (generation_config.json, a GGUF's eot) need not
    if dataclasses.replace(base_cfg, generation_eos_token_ids=()) != dataclasses.replace(
            model.config, generation_eos_token_ids=()):
        source.close()
        raise CheckpointError(f"base {base} is not the checkpoint of this model (its config differs); "
                              "pass the directory or .gguf the model was converted from")
    return source


def save_merged(
    model: CausalLM,
    out_dir: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    tokenizer: Any = None,
    dtype: str = "bfloat16",
) -> None:
    """Writes a merged HF checkpoint (sharded safetensors, config.json, tokenizer) atomically.

    With `base` (the HF directory or .gguf of the ORIGINAL weights) the adapters are added onto those; without it, onto
    the dequantized NF4 weights, which loses quality (a warning says so). `dtype="nf4"` re-quantizes the merged
    projections to NF4 as bitsandbytes stores them (double-quantized, blocks of 64; the rest in bfloat16): a
    bnb-4bit checkpoint that transformers + bitsandbytes, and jaxtune, load.
    """
    if dtype not in MERGED_DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of: {', '.join(MERGED_DTYPES)}")
    if in_nf4 := dtype == "nf4":
        model.config.require_dense("exporting a merged NF4 checkpoint (use a 16-bit dtype)")
    source = open_original(model, base)
    out_dtype = _DTYPES["bfloat16" if in_nf4 else dtype]
    try:
        with atomic_directory(out_dir) as tmp:
            tensors = list(merged_tensors(model, source))
            quantized = {t.name for t in tensors if in_nf4 and _is_projection_weight(t.name)}
            specs = []
            for t in tensors:
                if t.name in quantized:
                    specs += [(_bnb_name(t.name, k), shape, dt) for k, (shape, dt) in nf4.bnb_tensor_specs(t.shape).items()]
                else:
                    specs.append((t.name, t.shape, np.dtype(out_dtype)))
            with ShardedSafetensorsWriter(tmp, specs, metadata={"format": "pt"}) as writer:
                for t in tqdm(tensors, desc="merging", unit="tensor", leave=False):
                    if t.name in quantized:
                        for k, array in nf4.to_bnb(t.compute()).items():
                            if k == "quant_state.bitsandbytes__nf4":  # padded to the size laid out
                                array = np.frombuffer(array.tobytes().ljust(nf4.QUANT_STATE_BYTES), np.uint8)
                            writer.write(_bnb_name(t.name, k), array)
                    else:
                        writer.write(t.name, t.compute().astype(out_dtype))
            config = {**model.config.to_hf(), "torch_dtype": "bfloat16" if in_nf4 else dtype,
                      "dtype": "bfloat16" if in_nf4 else dtype}
            if in_nf4:
                config["quantization_config"] = dict(BNB_CONFIG)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
            write_generation_config(tmp, model.config)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    finally:
        if source is not None:
            source.close()
