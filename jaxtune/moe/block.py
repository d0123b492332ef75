"""The sparse feed-forward block: route each token to its top-k experts, group the routed rows by expert, run
gate/up/down as grouped GEMMs, and sum each token's expert outputs weighted by its routing weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.moe import balancing
from jaxtune.moe.experts import ExpertLinear
from jaxtune.moe.layout import tile_layout
from jaxtune.moe.routing import route


class Router(nnx.Module):
    """The router's weight [E, hidden]: never quantized, never adapted (it decides which experts run)."""

    def __init__(self, experts: int, hidden: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (experts, hidden), dtype))


class SparseMoE(nnx.Module):
    """Qwen3-MoE's / Mixtral's sparse MLP in HF's per-expert layout (`experts` stacks gate/up/down as [E, ...])."""

    def __init__(self, cfg, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.num_experts, self.top_k, self.normalize = e, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = Router(e, h, dtype=dtype, rngs=rngs)
        self.gate_proj = ExpertLinear(e, h, i, dtype=dtype, rngs=rngs)
        self.up_proj = ExpertLinear(e, h, i, dtype=dtype, rngs=rngs)
        self.down_proj = ExpertLinear(e, i, h, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None, token_tile: int | None = None) -> jax.Array:
        b, t, hidden = x.shape
        flat = x.reshape(b * t, hidden)
        routing = route(flat, self.router.weight[...], self.top_k, self.normalize)
        balancing.record(routing, self.num_experts)  # the load-balancing loss's statistics, when collected
        layout = tile_layout(routing.experts, self.num_experts)
        # each token's k copies are a broadcast (its gradient a sum, not a scatter-add); every routed row has a
        # padded row of its own (unique indices: no atomic updates either way)
        copies = jnp.broadcast_to(flat[:, None, :], (b * t, self.top_k, hidden)).reshape(-1, hidden)
        rows = jnp.zeros((layout.rows, hidden), x.dtype).at[layout.position].set(copies, unique_indices=True)
        key = (lambda i: None) if rng is None else (lambda i: jax.random.fold_in(rng, i))  # noqa: E731
        gate = self.gate_proj(rows, layout, key(4))
        h = jax.nn.silu(gate) * self.up_proj(rows, layout, key(5))
        out = self.down_proj(h, layout, key(6)).at[layout.position].get(unique_indices=True)
        out = out.reshape(b * t, self.top_k, hidden)
        weights = routing.weights.astype(x.dtype)[..., None]
        return jnp.sum((out * weights).astype(jnp.float32), axis=1).astype(x.dtype).reshape(b, t, hidden)
