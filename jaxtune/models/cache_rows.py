"""Rows of a decoding cache replaced one by one: a slot of continuous batching takes a new prompt's prefill while
the other slots keep decoding (`jaxtune.rl.continuous`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.models.blocks.gated_deltanet import LinearCache
from jaxtune.models.cache import KVCache


def _put(stack: jax.Array, rows: jax.Array, slots: jax.Array, index: jax.Array) -> jax.Array:
    """stack [(L,) B, S, ...] with rows [(L,) R, P, ...] written at batch rows `slots` [R] and sequence entries
    `index` [P]; slots out of range are dropped."""
    at = (slots[:, None], index[None, :])
    if stack.ndim == rows.ndim and stack.ndim == 5:  # every layer's stack [L, B, S, H, D]
        return stack.at[(slice(None), *at)].set(rows.astype(stack.dtype), mode="drop")
    return stack.at[at].set(rows.astype(stack.dtype), mode="drop")


def place_rows(cache: KVCache, prefill: KVCache, slots: jax.Array, start: jax.Array) -> KVCache:
    """`cache` (a ring of S entries per row) with batch rows `slots` [R] holding `prefill`'s rows (a prefill's
    cache of R rows and P entries): entry j at ring index (start + j) mod S, the row's other entries emptied
    (segment 0, never attended), and its Gated DeltaNet windows and states replaced. A slot >= the batch is a row
    with nothing to place (dropped)."""
    length, p = cache.segment_ids.shape[1], prefill.segment_ids.shape[1]
    index = (start + jnp.arange(p, dtype=jnp.int32)) % length
    segments = cache.segment_ids.at[slots].set(0, mode="drop")
    segments = segments.at[slots[:, None], index[None, :]].set(prefill.segment_ids, mode="drop")
    k = jax.tree.map(lambda c, r: _put(c, r, slots, index), cache.k, prefill.k)
    v = jax.tree.map(lambda c, r: _put(c, r, slots, index), cache.v, prefill.v)
    linear = cache.linear
    if linear is not None:  # [L, B, ...]: the batch is the second axis
        linear = LinearCache(linear.conv.at[:, slots].set(prefill.linear.conv.astype(linear.conv.dtype), mode="drop"),
                             linear.state.at[:, slots].set(prefill.linear.state, mode="drop"), linear.layer)
    return KVCache(k, v, segments, linear)
