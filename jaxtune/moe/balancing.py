"""The router's load-balancing loss, as transformers computes it (`load_balancing_loss_func`, added to the loss
times `router_aux_loss_coef` when a config sets `output_router_logits`): over every sparse layer's tokens (padding
excluded), E * sum_e f_e * P_e, with f_e the share of top-k assignments that went to expert e per token and P_e the
mean router probability of e. Only P_e carries a gradient (through the router's inputs: the adapters below it).

Each sparse layer adds its counts and probability sums to a collector the layer loop carries from layer to layer
(`collecting` around a layer's call; the MoE block adds its `statistics`), so the loss needs no second pass.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from jaxtune.moe.routing import Routing

_collector: contextvars.ContextVar[tuple[jax.Array, list] | None] = contextvars.ContextVar("router_stats",
                                                                                          default=None)


def stats_size(num_experts: int) -> int:
    """Length of the accumulated statistics: assignments per expert, probability sums per expert, token count."""
    return 2 * num_experts + 1


@contextlib.contextmanager
def collecting(token_mask: jax.Array) -> Iterator[list[jax.Array]]:
    """Statistics of the MoE blocks traced inside, one [stats_size] vector per block; `token_mask` [B, T] marks
    the tokens that count (not padding)."""
    got: list[jax.Array] = []
    reset = _collector.set((token_mask.reshape(-1).astype(jnp.float32), got))
    try:
        yield got
    finally:
        _collector.reset(reset)


def collecting_mask() -> jax.Array | None:
    """The token mask [N] of the collector in force (None: no statistics are collected)."""
    collector = _collector.get()
    return None if collector is None else collector[0]


def statistics(routing: Routing, num_experts: int, mask: jax.Array) -> jax.Array:
    """One block's statistics [stats_size] over the tokens `mask` [N] marks."""
    probs = jax.nn.softmax(routing.logits.astype(jnp.float32), axis=-1)  # [N, E]
    picked = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)  # [N, k, E]
    counts = jnp.einsum("nke,n->e", picked, mask)
    return jnp.concatenate([counts, jnp.einsum("ne,n->e", probs, mask), jnp.sum(mask)[None]])


def add(stats: jax.Array) -> None:
    """Adds one block's statistics to the collector in force."""
    _collector.get()[1].append(stats)


def load_balancing_loss(stats: jax.Array, num_experts: int) -> jax.Array:
    """The loss of the statistics summed over the layers ([stats_size])."""
    rows = jnp.maximum(stats[-1], 1.0)
    assigned, probs = stats[:num_experts] / rows, stats[num_experts:2 * num_experts] / rows
    return num_experts * jnp.sum(jax.lax.stop_gradient(assigned) * probs)
