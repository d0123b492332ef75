"""The decoder (Llama 2/3, Mistral, Qwen2/3, their mixtures of experts, gpt-oss, Qwen3.5's hybrid) as Flax NNX modules:
the decoder layer and the model that runs the layers. The blocks live in `blocks/` (attention, MLP, Gated
DeltaNet), the plain layers in `layers.py`, the decoding caches in `cache.py`.

Parameter paths mirror Hugging Face names (`layers.self_attn.q_proj.weight`, ...) so checkpoint I/O is a
rename. Decoder layers are stored stacked along a leading layer axis and run as one loop (`jax.lax.scan`;
for training `jaxtune.models.layer_loop`, which saves activations in place): one compiled layer body, so compile time
does not grow with depth. Training may unroll that loop instead (`unroll_layers`: faster steps, longer compiles),
and so does decoding with a KV cache per layer (`KVCache`: GRPO's rollouts on a GPU).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtune import ops
from jaxtune.models.blocks.attention import Attention
from jaxtune.models.blocks.gated_deltanet import GatedDeltaNet, LinearCache
from jaxtune.models.blocks.gemma4_layer import Gemma4DecoderLayer
from jaxtune.models.blocks.mlp import MLP
from jaxtune.models.cache import KVCache, LayerCache
from jaxtune.models.config import ModelConfig
from jaxtune.models.layer_kinds import (DEFAULT, DENSE_MLP, GATED_DELTANET, LayerRun, LayerStack, attention_position,
                                        attention_window, full_rope, layer_runs, layer_stacks, runs_layer_by_layer)
from jaxtune.models.layers import Embed, Linear, RMSNorm
from jaxtune.models import layer_by_layer
from jaxtune.models.layer_loop import layer_loop
from jaxtune.moe import balancing
from jaxtune.moe.block import SparseMoE
from jaxtune.models.remat import remat_policy, split_offload_scan
from jaxtune.models.rope import rope_tables

__all__ = ["MLP", "Attention", "CausalLM", "DecoderLayer", "Embed", "KVCache", "LayerCache", "Linear", "RMSNorm",
           "abstract_model", "init_model", "offload_mlp_token_tile", "segment_positions"]

class DecoderLayer(nnx.Module):
    """The token mixer then the MLP, each pre-normed and added to the residual. The mixer is attention, or for
    `kind` GATED_DELTANET (a hybrid decoder's linear layers) Gated DeltaNet; for `kind` DENSE_MLP a mixture of
    experts' layer has a dense MLP."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, kind: str = DEFAULT):
        norm = lambda: RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        # the token mixer: attention, or a hybrid decoder's Gated DeltaNet linear attention
        self.linear = kind == GATED_DELTANET
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, Linear, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, sliding_window=attention_window(cfg, kind), kind=kind)
        self.post_attention_layernorm = norm()
        sparse = cfg.num_experts and kind != DENSE_MLP
        if sparse and cfg.shared_expert_intermediate_size:
            self.mlp = SparseMoE(cfg, dtype=dtype, rngs=rngs,
                                 shared_expert=MLP(cfg, dtype=dtype, rngs=rngs, width=cfg.shared_expert_intermediate_size),
                                 shared_expert_gate=Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, rngs=rngs))
        else:
            self.mlp = SparseMoE(cfg, dtype=dtype, rngs=rngs) if sparse else MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segment_ids, cache=None, cache_segment_ids=None, cache_index=None, rng=None,
                 mlp_token_tile=None):
        if self.linear:  # its cache: the Gated DeltaNet layers' windows and states (LinearCache), or none
            attn, cache = self.linear_attn(self.input_layernorm(x), segment_ids, rng, cache)
        else:
            attn, cache = self.self_attn(
                self.input_layernorm(x), cos, sin, segment_ids, cache, cache_segment_ids, cache_index, rng
            )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), rng, mlp_token_tile), cache


# the decoder layer of each `ModelConfig.block`
LAYER_CLASSES = {"llama": DecoderLayer, "gemma4": Gemma4DecoderLayer}


def _stacked_layers(cfg: ModelConfig, dtype: jnp.dtype, rngs: nnx.Rngs, stack: LayerStack) -> DecoderLayer:
    """The stack's decoder layers as one module whose arrays carry a leading layer axis."""
    keys = jax.random.split(rngs.params(), len(stack.layers))
    layer_class = LAYER_CLASSES[cfg.block]
    build = lambda key: layer_class(cfg, dtype=dtype, rngs=nnx.Rngs(key), kind=stack.kind)  # noqa: E731
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(0)))
    state = jax.vmap(lambda key: nnx.state(build(key)))(keys)
    return nnx.merge(graphdef, state)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions that restart at 0 at every segment boundary (packed samples), [B, T] int32."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class CausalLM(nnx.Module):
    """Decoder-only LM: `model(input_ids, positions=None, segment_ids=None) -> logits [B, T, V]` (float32).

    With segment ids, each token attends causally within its own segment only (sample packing) and
    positions restart per segment unless given.
    """

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype = jnp.bfloat16, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        # one stack per layer kind (`layer_kinds`): `layers`, and e.g. `dense_mlp_layers` beside it
        for stack in layer_stacks(cfg):
            setattr(self, stack.attr, _stacked_layers(cfg, dtype, rngs, stack))
        if cfg.per_layer_dim:  # Gemma 4's small models: each token's input to every layer (`layer_by_layer`)
            for name, module in layer_by_layer.per_layer_modules(cfg, dtype, rngs).items():
                setattr(self, name, module)
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)
        self.lm_head = (
            None if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, rngs=rngs)
        )
        self.remat_policy: str = "none"
        # Every row holds one sequence (then padding): attention can ignore segment ids and run plain causal,
        # which cuDNN serves. Exact for every real token, since padding only ever follows it.
        self.single_sequence_rows: bool = False
        # remat "offload": one layer input in every `offload_group` goes to host memory; the layers between are
        # recomputed from it (one more forward each) when host memory cannot hold every layer's input
        self.offload_group: int = 1
        # remat "offload": the inputs of the last `offload_device_layers` layers stay in device memory instead
        # (the alternative to recomputing more when host memory is short and the device has room)
        self.offload_device_layers: int = 0
        # "fp8": the frozen NF4 projections run as FP8 GEMMs (forward and input gradient; q/k's forward
        # excepted); set by train() in the step's graphdef only, like the two flags above
        self.compute: str = "bf16"
        # training traces one layer per decoder layer instead of a loop: no stacks of saved activations to copy
        # into and out of (faster), a compile time that grows with the layer count; remat "offload" keeps its
        # own loops
        self.unroll_layers: bool = False
        # quantization-aware training: "q4_0", "q4_k" or "nf4" puts each LoRA projection's merged weight through
        # that format's quantizer in the forward pass (straight-through gradient); set by train() like `compute`
        self.qat: str | None = None
        # a mixture of experts' routers also count what the load-balancing loss needs
        # (`hidden_states_and_balancing_loss`); set by train() in the step's graphdef when the config asks for it
        self.router_aux: bool = False

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        dropout_rng: jax.Array | None = None,
    ) -> jax.Array:
        return self.logits(self.hidden_states(input_ids, positions, segment_ids, dropout_rng=dropout_rng))

    def hidden_states(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        dropout_rng: jax.Array | None = None,
    ) -> jax.Array:
        """Final-norm hidden states [B, T, H], for losses that apply the lm_head in chunks.

        `dropout_rng` switches LoRA dropout on (training); without it the model is deterministic.
        """
        out = self._hidden_states(input_ids, positions, segment_ids, dropout_rng)
        return out[0] if isinstance(out, tuple) else out

    def hidden_states_and_balancing_loss(
        self,
        input_ids: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        dropout_rng: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """(`hidden_states`, the routers' load-balancing loss over the tokens that are not padding), the loss as
        transformers' `load_balancing_loss_func` computes it; needs `router_aux` (set by train() when the
        config asks for the loss)."""
        out = self._hidden_states(input_ids, positions, segment_ids, dropout_rng)
        if not isinstance(out, tuple):
            raise ValueError("hidden_states_and_balancing_loss needs a mixture of experts with router_aux set")
        h, stats = out
        return h, balancing.load_balancing_loss(stats, self.config.num_experts)

    def _hidden_states(self, input_ids, positions, segment_ids, dropout_rng):
        """The hidden states, or (them, the load-balancing statistics summed over the layers) under router_aux."""
        if positions is None:
            if segment_ids is None:
                positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
            else:
                positions = segment_positions(segment_ids)
        # the tokens the load-balancing loss counts: not padding (taken before single_sequence_rows drops the ids)
        tokens = segment_ids > 0 if self.router_aux and segment_ids is not None else None
        if self.single_sequence_rows:
            segment_ids = None
        with ops.frozen_compute(self.compute), ops.fake_quantized(self.qat):
            h, _ = self._decode(input_ids, positions, segment_ids, None, None, dropout_rng, tokens)
        return h

    def head_weight(self) -> jax.Array:
        """The output projection [V, H]: lm_head, or the embedding when tied."""
        return self.embed_tokens.weight[...] if self.lm_head is None else self.lm_head.weight[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """lm_head (or the tied embedding) applied to hidden states, float32 logits (soft-capped where the config
        says)."""
        return softcap(ops.linear(hidden, self.head_weight(), out_dtype=jnp.float32),
                       self.config.final_logit_softcapping)

    def forward_with_cache(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        cache: KVCache,
        cache_index: jax.Array,
        last_only: bool = False,
    ) -> tuple[jax.Array, KVCache]:
        """Runs new tokens [B, T] written at cache slots [cache_index, cache_index + T); returns logits and cache.
        `last_only`: logits of the last token only ([B, 1, V]; a prefill needs no more, and all T positions' float32
        logits would be the largest array of a sampled batch's prefill)."""
        seg = jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids.astype(jnp.int32), (0, cache_index))
        h, (written, linear) = self._decode(input_ids, positions, segment_ids, (LayerCache(cache.k, cache.v),
                                                                              cache.linear), (seg, cache_index))
        return self.logits(h[:, -1:] if last_only else h), KVCache(written.k, written.v, seg, linear)

    def _decode(self, input_ids, positions, segment_ids, cache, cache_args, dropout_rng=None, tokens=None):
        # RoPE's tables for each kind of layer that has its own (Gemma 4's full-attention layers), made once
        tables = {full: rope_tables(self.config, positions, full)
                  for full in {full_rope(self.config, s.kind) for s in layer_stacks(self.config)}}
        h = self.embed_tokens(input_ids).astype(self.dtype)
        if self.config.scale_embeddings:  # Gemma: times sqrt(hidden), the factor rounded to the weights' dtype
            h = h * jnp.asarray(self.config.hidden_size**0.5, self.dtype)
        # the load-balancing loss's statistics ride beside the hidden states through the layers
        aux = self.router_aux and cache is None and bool(self.config.num_experts)
        if aux and tokens is None:
            tokens = jnp.ones(input_ids.shape, bool)
        if aux:
            h = (h, jnp.zeros(balancing.stats_size(self.config.num_experts), jnp.float32))
        cache_seg, cache_index = cache_args if cache_args is not None else (None, None)
        layer_rngs = None if dropout_rng is None else jax.random.split(dropout_rng, self.config.num_layers)
        if runs_layer_by_layer(self.config):
            per_layer = (layer_by_layer.per_layer_inputs(self, input_ids, h) if self.config.per_layer_dim else None)
            kv = None if cache is None else (cache[0].k, cache[0].v)
            h, kv = layer_by_layer.run_layers(self, h, tables, segment_ids, kv, cache_seg, cache_index, layer_rngs,
                                              per_layer)
            return (self.norm(h), None) if cache is None else (self.norm(h), (LayerCache(*kv), cache[1]))
        # the layers run in order, a loop per run of one kind's consecutive layers (one run: every layer alike)
        on_device = self.offload_device_layers if self.remat_policy == "offload" and cache is None else 0
        cache, linear = (None, None) if cache is None else cache
        k, v = (None, None) if cache is None else (cache.k, cache.v)
        for run in layer_runs(self.config):
            after = self.config.num_layers - run.first - run.count
            rngs = None if layer_rngs is None else layer_rngs[run.first:run.first + run.count]
            cos, sin = tables[full_rope(self.config, run.stack.kind)]
            h, k, v, linear = self._run_layers(run, h, k, v, linear, (cos, sin, segment_ids), cache_seg, cache_index,
                                               rngs, aux, tokens, min(run.count, max(0, on_device - after)))
        if cache is None:
            return self._final(h), None
        return self.norm(h), (LayerCache(k, v), linear)

    def _run_layers(self, run: LayerRun, h, k, v, linear, constants, cache_seg, cache_index, layer_rngs, aux, tokens,
                    on_device: int):
        """h (and the KV cache k, v, and the Gated DeltaNet layers' `linear` cache) after the run's layers: the loop
        that fits the call (training, remat offload, a stacked or per-layer cache)."""
        cache = k is not None
        offloading = self.remat_policy == "offload" and not cache
        group = self.offload_group if offloading else 1
        if len(layer_runs(self.config)) > 1 and (run.count - on_device) % group:
            group = 1  # layers of several kinds: a run the group does not divide offloads each layer's input
        # the prepared kernel scales of every layer (float32, ~6% of the NF4 weights' size: 4 GiB at 70B) live
        # through the step; training modes chosen to save memory compute each layer's own inside the scan instead
        # (~0.5% slower at 8B), as the grouped offload layout does
        per_layer_scales = not cache and self.remat_policy in ("full", "offload")
        stack = getattr(self, run.stack.attr)
        layers = stack if group > 1 or on_device or per_layer_scales else self._kernel_ready_layers(run.stack.attr)
        whole_stack = run.start == 0 and run.count == len(run.stack.layers)
        graphdef, layer_state = nnx.split(layers)
        # long-context mode: with layer inputs offloaded, the MLP's [tokens, intermediate] tensors are the peak
        mlp_token_tile = offload_mlp_token_tile(self.config) if self.remat_policy == "offload" else None

        def body(h, xs, constants=constants):
            state, layer_cache, rng = xs
            layer = nnx.merge(graphdef, state)
            h, stats = h if aux else (h, None)
            h = checkpoint_name(h, "layer_input")  # what the "offload" policy moves to host memory
            # memory-first training keeps one dequantized weight alive at a time, not a layer's worth
            with ops.dequantize_at_use(per_layer_scales), (
                    balancing.collecting(tokens) if aux else contextlib.nullcontext([])) as counted:
                out, written = layer(h, *constants, layer_cache, cache_seg, cache_index, rng, mlp_token_tile)
            return ((out, stats + sum(counted)) if aux else out), written

        def run_part(tree):  # the run's layers of its stack (a copy, where the run is not the whole stack)
            return tree if whole_stack else jax.tree.map(lambda a: a[run.start:run.start + run.count], tree)

        if group > 1 or on_device:
            return (split_offload_scan(body, h, run_part(layer_state), layer_rngs, run.count, group, on_device), k, v,
                    linear)
        # the NF4 codes (and their prepared kernel scales) stay whole (constants of the scan) and each layer reads
        # its own in place: the kernels that dequantize them would otherwise get a copy of every layer's codes (a
        # custom call's operand is a buffer of its own, never a slice of one)
        whole = nnx.Any(*(nnx.PathContains(name) for name in WHOLE_IN_LAYER_SCAN))
        _, codes_state, sliced_state = nnx.split(layers, whole, ...)
        sliced_state = run_part(sliced_state)

        def stacked_body(h, xs, codes=codes_state, constants=constants):
            sliced, layer_cache, rng, index = xs
            with ops.stacked_layer(index):
                return body(h, (nnx.merge_state(codes, sliced), layer_cache, rng), constants)

        training = not cache and self.remat_policy != "offload"
        unrolled = training and self.unroll_layers

        def rematerialized(fn):
            if self.remat_policy == "none":
                return fn
            # unrolled, nothing keeps the compiler from merging the backward's recomputation into the forward
            return jax.checkpoint(fn, policy=remat_policy(self.remat_policy), prevent_cse=unrolled)

        if training:  # residuals written in place
            # the loop's constants are arguments of the layer: the loop tells them from per-layer values by identity
            def layer_fn(h, per_layer, invariant, index):
                (sliced, rng), (codes, *constants) = per_layer, invariant
                return stacked_body(h, (sliced, None, rng, index), codes, tuple(constants))[0]

            h = layer_loop(rematerialized(layer_fn), h, (sliced_state, layer_rngs), (codes_state, *constants),
                           run.count, unrolled=unrolled, first_index=run.start)
            return h, k, v, linear
        indices = jnp.arange(run.start, run.start + run.count, dtype=jnp.int32)  # positions in the stack
        if not cache:  # remat "offload" on one group of layers: the plain loop, no cache
            h, _ = jax.lax.scan(rematerialized(stacked_body), h, (sliced_state, None, layer_rngs, indices))
            return h, k, v, linear
        if run.stack.kind == GATED_DELTANET:  # the stack's positions index the windows and states
            def linear_body(carry, xs):
                h, conv, state = carry
                sliced, rng, index = xs
                h, written = stacked_body(h, (sliced, LinearCache(conv, state, index), rng, index))
                return (h, written.conv, written.state), None

            if isinstance(k, tuple):  # per-layer decoding: one traced layer per layer here too
                conv, state = linear.conv, linear.state
                for j in range(run.count):
                    sliced = jax.tree.map(lambda a, j=j: a[j], sliced_state)
                    with ops.static_layer(run.start + j):
                        (h, conv, state), _ = linear_body((h, conv, state), (sliced, None, jnp.int32(run.start + j)))
            else:
                (h, conv, state), _ = jax.lax.scan(linear_body, (h, linear.conv, linear.state),
                                                   (sliced_state, layer_rngs, indices))
            return h, k, v, LinearCache(conv, state)
        # a stack position + this: the KV cache's index (the decoder layer's place among those that attend)
        to_decoder = attention_position(self.config, run.first) - run.start

        def cached_body(carry, xs):  # the cache stacks ride in the carry: each layer updates them in place
            h, k, v = carry
            sliced, rng, index = xs
            h, written = stacked_body(h, (sliced, LayerCache(k, v, index + to_decoder), rng, index))
            return (h, written.k, written.v), None

        if isinstance(k, tuple):  # per-layer caches: one traced layer per decoder layer
            k, v = list(k), list(v)
            for j in range(run.count):
                sliced = jax.tree.map(lambda a, j=j: a[j], sliced_state)
                i = run.start + j + to_decoder
                with ops.static_layer(run.start + j):
                    h, written = stacked_body(h, (sliced, LayerCache(k[i], v[i], None), None, jnp.int32(run.start + j)))
                k[i], v[i] = written.k, written.v
            return h, tuple(k), tuple(v), linear
        (h, k, v), _ = jax.lax.scan(rematerialized(cached_body), (h, k, v), (sliced_state, layer_rngs, indices))
        return h, k, v, linear

    def _final(self, h):
        """The final norm of the last layer's hidden states (and the load-balancing statistics as they are, where
        they ride beside them)."""
        if isinstance(h, tuple):
            return self.norm(h[0]), h[1]
        return self.norm(h)

    def layer_stacks(self) -> list[tuple[LayerStack, nnx.Module]]:
        """(stack, its stacked DecoderLayer module) for each layer kind, `layers` first."""
        return [(stack, getattr(self, stack.attr)) for stack in layer_stacks(self.config)]

    def _kernel_ready_layers(self, attr: str = "layers") -> nnx.Module:
        """A stack of decoder layers with every NF4 projection's kernel scales prepared for all its layers at once
        (a copy local to this trace) when Pallas kernels run; else the layers as they are."""
        def projections(layers):
            return [m for _, m in nnx.iter_modules(layers) if hasattr(m, "prepare_kernel_scales")]

        stack = getattr(self, attr)
        if not ops.kernels_read_prepared_scales() or all(m.kernel_absmax is not None for m in projections(stack)):
            return stack
        layers = nnx.clone(stack)
        for module in projections(layers):
            module.prepare_kernel_scales(ops.frozen_compute_mode() == "fp8")
        return layers

    def prepare_dense_weights(self, layers: int | None = None) -> None:
        """Dequantizes every NF4 projection of the first `layers` decoder layers (None: all) once, an array per
        layer, for decoding with per-layer caches (many tokens read the same weights: a bf16 copy read by the GEMMs
        instead of the 4-bit codes dequantized per token; the other layers keep decoding the codes). Only on a model
        local to a traced function, after `prepare_for_kernels`."""
        for stack, module in self.layer_stacks():
            count = None if layers is None else sum(i < layers for i in stack.layers)
            for _, projection in nnx.iter_modules(module):
                if hasattr(projection, "prepare_dense"):
                    projection.prepare_dense(self.dtype, count)

    def prepare_for_kernels(self) -> None:
        """Prepares the kernel scales once for many calls (token by token decoding). Only on a model local to a
        traced function: the scales are arrays of that trace."""
        for stack in layer_stacks(self.config):
            setattr(self, stack.attr, self._kernel_ready_layers(stack.attr))


def softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(logits / cap) (Gemma's final-logit soft-capping); the logits as they are for None."""
    return logits if cap is None else cap * jnp.tanh(logits / cap)


# long-context mode: the MLP's [tokens, intermediate] tensors of one token tile at most this many elements (16,384
# tokens of Llama-3-8B, 8,192 of 70B: 0.44 GiB per bf16 tensor)
OFFLOAD_MLP_TILE_ELEMENTS = 16384 * 14336


def offload_mlp_token_tile(cfg: ModelConfig) -> int:
    """The most tokens of one MLP tile in long-context mode: a bound on the intermediate tensors' size, not on
    tokens, so that wide MLPs (70B) do not take twice the memory of 8B's."""
    return max(128, OFFLOAD_MLP_TILE_ELEMENTS // cfg.intermediate_size // 128 * 128)

# variables the layer scan keeps whole (read at the layer's index in place) instead of slicing per layer
WHOLE_IN_LAYER_SCAN = layer_by_layer.WHOLE

def init_model(cfg: ModelConfig, *, dtype: str | jnp.dtype = "bfloat16", seed: int = 0) -> CausalLM:
    """A randomly initialized model (benchmarks, tests); use `jaxtune.from_pretrained` for checkpoints."""
    return CausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig, *, dtype: str | jnp.dtype = "bfloat16") -> CausalLM:
    """Shapes and dtypes only (no memory, no compute): the skeleton that loaders fill."""
    return nnx.eval_shape(lambda: CausalLM(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
