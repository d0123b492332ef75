"""The sparse feed-forward block: route each token to its top-k experts, group the routed rows by expert, run
gate/up/down as grouped GEMMs, and sum each token's expert outputs weighted by its routing weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.moe import balancing
from jaxtune.moe.expert_mlp import ExpertMLPSpec, expert_mlp
from jaxtune.moe.experts import ExpertLinear, NF4Experts, expert_projection
from jaxtune.moe.layout import tile_layout
from jaxtune.moe.routing import Routing, route
from jaxtune.models.layers import rms_normalize
from jaxtune.ops import dispatch
from jaxtune.ops.context import frozen_compute_mode
from jaxtune.ops.sharded import per_batch_shard_with
from jaxtune.parallel.sharding import batch_shards, current_mesh, whole_on_every_device
from jaxtune.quant.weights import QuantizedWeight


class Router(nnx.Module):
    """The router's weight [E, hidden] (and bias [E], gpt-oss): never quantized, never adapted (it decides which
    experts run). `scaled` (Gemma 4): its input RMS-normalized, times a learned `scale` [hidden] and
    1/sqrt(hidden); each chosen expert's weight times its learned `per_expert_scale` [E]."""

    def __init__(self, experts: int, hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = False,
                 scaled: bool = False, eps: float = 1e-6):
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (experts, hidden), dtype))
        self.bias = nnx.Param(jnp.zeros((experts,), dtype)) if bias else None
        self.scale = nnx.Param(jnp.ones((hidden,), dtype)) if scaled else None
        self.per_expert_scale = nnx.Param(jnp.ones((experts,), dtype)) if scaled else None
        self.eps = eps

    def route(self, x: jax.Array, top_k: int, normalize: bool) -> Routing:
        """The routing of tokens x [N, hidden]."""
        if self.scale is not None:  # in x's dtype, as the reference computes it
            normed = rms_normalize(x, self.eps).astype(x.dtype)
            x = normed * self.scale[...].astype(x.dtype) * jnp.asarray(x.shape[-1] ** -0.5, x.dtype)
        bias = None if self.bias is None else self.bias[...]
        routing = route(x, self.weight[...], top_k, normalize, bias)
        if self.per_expert_scale is None:
            return routing
        scales = jnp.take(self.per_expert_scale[...].astype(jnp.float32), routing.experts)
        return routing._replace(weights=routing.weights * scales)


class SparseMoE(nnx.Module):
    """Qwen3-MoE's / Mixtral's sparse MLP in HF's per-expert layout (`experts` stacks gate/up/down as [E, ...]);
    with `shared_expert` (Qwen3.5-MoE) a dense MLP every token runs beside its routed experts, its output scaled by
    sigmoid(`shared_expert_gate`(x)) and added."""

    def __init__(self, cfg, *, dtype: jnp.dtype, rngs: nnx.Rngs, shared_expert: nnx.Module | None = None,
                 shared_expert_gate: nnx.Module | None = None):
        h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.num_experts, self.top_k, self.normalize = e, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = Router(e, h, dtype=dtype, rngs=rngs, bias=cfg.moe_bias, scaled=cfg.router_scaled,
                             eps=cfg.rms_norm_eps)
        self.gate_proj = ExpertLinear(e, h, i, dtype=dtype, rngs=rngs, bias=cfg.moe_bias)
        self.up_proj = ExpertLinear(e, h, i, dtype=dtype, rngs=rngs, bias=cfg.moe_bias)
        self.down_proj = ExpertLinear(e, i, h, dtype=dtype, rngs=rngs, bias=cfg.moe_bias)
        self.activation = cfg.moe_activation
        self.swiglu_alpha, self.swiglu_limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    def __call__(self, x: jax.Array, rng: jax.Array | None = None, token_tile: int | None = None,
                 router_x: jax.Array | None = None) -> jax.Array:
        """`router_x`: what the router reads where it is not the experts' input (Gemma 4 routes the layer's
        un-normed hidden states)."""
        b, t, _ = x.shape
        mask = balancing.collecting_mask()  # the load-balancing loss's tokens, when its statistics are collected
        mask = None if mask is None else mask.reshape(b, t)
        if current_mesh() is None:
            out, stats = self.routed(x, mask, rng, router_x)
        else:
            out, stats = _per_batch_shard(self, x, mask, rng, router_x)
        if stats is not None:
            balancing.add(stats)
        if self.shared_expert is not None:  # one dense GEMM per projection beside the routed ones
            gate = jax.nn.sigmoid(self.shared_expert_gate(x, None).astype(jnp.float32)).astype(x.dtype)
            out = out + gate * self.shared_expert(x, None if rng is None else jax.random.fold_in(rng, 7))
        return out

    def routed(self, x: jax.Array, mask: jax.Array | None, rng: jax.Array | None,
               router_x: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """(the block's output, its load-balancing statistics over `mask`'s tokens or None) on one device."""
        b, t, hidden = x.shape
        flat = x.reshape(b * t, hidden)
        routing = self.router.route(flat if router_x is None else router_x.reshape(b * t, hidden), self.top_k,
                                    self.normalize)
        stats = None if mask is None else balancing.statistics(routing, self.num_experts, mask.reshape(-1))
        layout = tile_layout(routing.experts, self.num_experts)
        key = (lambda i: None) if rng is None else (lambda i: jax.random.fold_in(rng, i))  # noqa: E731
        fp8 = dispatch.moe_fp8_impl() if frozen_compute_mode() == "fp8" else None
        parts = [expert_projection(p, x.dtype, fp8 is not None) for p in (self.gate_proj, self.up_proj, self.down_proj)]
        spec = ExpertMLPSpec(self.top_k, layout.rows, layout.block_m, self.activation, self.swiglu_alpha,
                             self.swiglu_limit, tuple(p[1] for p in parts), tuple(p[2] for p in parts), fp8)
        out = expert_mlp(flat, routing.weights, layout, tuple(p[0] for p in parts), spec, (key(4), key(5), key(6)))
        out = out.reshape(b, t, hidden)
        return out, stats


def _per_batch_shard(block: SparseMoE, x: jax.Array, mask: jax.Array | None, rng: jax.Array | None,
                     router_x: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """`block.routed` on each device's own rows of a mesh, the layer's weights gathered whole on every device (as
    FSDP gathers a dense layer's, the NF4 codes 1 byte each). Routed on the global rows instead, the grouped
    kernel (a custom call, which XLA cannot partition) ran every expert's GEMM over every device's rows on every
    device. The statistics come out per device and are summed."""
    local = nnx.clone(block)
    for _, module in nnx.iter_modules(local):
        if isinstance(module, NF4Experts):  # this layer's codes, not the whole stack the layer loop passes
            module.codes = QuantizedWeight(module.weight_nf4.own_codes())
    graphdef, weights = nnx.split(local)
    weights = jax.tree.map(lambda a: whole_on_every_device(a)[0], weights)
    # per row of the batch split: the token mask, and a dropout key per device (the first one on every device
    # when the rows do not split and each device computes them all)
    keys = None if rng is None else jax.random.split(rng, batch_shards(current_mesh()))
    per_row = {"mask": mask, "keys": keys, "router_x": router_x}

    def on_device(x, per_row, weights):
        rng = None if per_row["keys"] is None else per_row["keys"][0]
        out, stats = nnx.merge(graphdef, weights).routed(x, per_row["mask"], rng, per_row["router_x"])
        return out, (None if stats is None else stats[None])

    out, stats = per_batch_shard_with(on_device, (x, per_row), (weights,))
    return out, (None if stats is None else jnp.sum(stats, axis=0))
