"""Who attends to whom in a row of packed segments, and the per-token bounds the flash kernels loop over.

Segment ids [B, T] name contiguous runs; a query sees keys of its own run. With shared prefixes (preference
pairs: one prompt, two responses in one row) a negative id s marks a branch that also sees the run of id
(-s) // 2 before it (the prompt run p, its branches -2p and -2p-1); prefix ids are positive and below T.
Everything here is O(T) per row (segment reductions), never [T, T], except `segments_visible` on what it is given.
The references' softmax with attention sinks (`softmax_with_sinks`) lives here too, shared as the segment rule is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def prefix_ids(segment_ids: jax.Array) -> jax.Array:
    """The id of the run each token may see besides its own: (-s) // 2 for a branch (s < 0), else s itself."""
    return jnp.where(segment_ids < 0, (-segment_ids) // 2, segment_ids)


def segments_visible(q_seg: jax.Array, k_seg: jax.Array, shared_prefix: bool) -> jax.Array:
    """Whether keys of segment k_seg are visible to queries of segment q_seg (broadcasting): the same segment,
    or, with shared prefixes, the prefix run of a branch."""
    same = q_seg == k_seg
    return same | (prefix_ids(q_seg) == k_seg) if shared_prefix else same


def segment_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """First and last index of each token's segment run, [B, T] int32 each."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    new_run = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    run_end = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones((b, 1), bool)], axis=1)
    start = jax.lax.cummax(jnp.where(new_run, idx, 0), axis=1)
    end = jax.lax.cummin(jnp.where(run_end, idx, t - 1), axis=1, reverse=True)
    return start, end


def _reduce_by_id(values: jax.Array, ids: jax.Array, reduce, read_at: jax.Array) -> jax.Array:
    """`reduce` (a jax.ops.segment_* reduction) of `values` over the tokens of each id of a row (ids in [0, T]),
    read back per token at the ids `read_at`; [B, T] each."""
    b, t = values.shape
    rows = jnp.arange(b, dtype=jnp.int32)[:, None] * (t + 1)
    per_id = reduce(values.reshape(-1), (rows + ids).reshape(-1), num_segments=b * (t + 1))
    return per_id[(rows + read_at).reshape(-1)].reshape(b, t)


def _runs_and_prefixes(segment_ids: jax.Array):
    """Token indices, each token's own id as a prefix run (branches: 0, no run) and its prefix id, clipped to
    [0, T] for `_reduce_by_id`."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return idx, jnp.clip(segment_ids, 0, t), jnp.clip(prefix_ids(segment_ids), 0, t)


def visible_bounds(segment_ids: jax.Array, shared_prefix: bool) -> tuple[jax.Array, jax.Array]:
    """Per token, the first key index its query may see and the last query index that may see its key, [B, T]
    int32 each: its own run's bounds, widened to the prefix run (queries) and to the prefix's branches (keys)."""
    start, end = segment_bounds(segment_ids)
    if not shared_prefix:
        return start, end
    idx, own, prefix = _runs_and_prefixes(segment_ids)
    branch = segment_ids < 0
    prefix_start = _reduce_by_id(idx, own, jax.ops.segment_min, prefix)
    last_branch = _reduce_by_id(jnp.where(branch, idx, -1), prefix, jax.ops.segment_max, prefix)
    start = jnp.where(branch, jnp.minimum(start, prefix_start), start)
    return start, jnp.where(branch, end, jnp.maximum(end, last_branch))


def prefix_gap(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token, the start of its own run and the last index of its prefix run (a branch), or its own start - 1:
    the keys strictly between are invisible to it (the other branch of its pair)."""
    own_start, _ = segment_bounds(segment_ids)
    idx, own, prefix = _runs_and_prefixes(segment_ids)
    prefix_end = _reduce_by_id(idx, own, jax.ops.segment_max, prefix)
    return own_start, jnp.where(segment_ids < 0, jnp.minimum(prefix_end, own_start - 1), own_start - 1)


def softmax_with_sinks(scores, sinks, kv_heads: int):
    """softmax over the last axis of scores [B, Hkv, G, T, S] with one more logit per query head (sinks [Hkv * G],
    gpt-oss) in each row's normalizer, which attends to nothing: the row's weights without it."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = sinks.astype(scores.dtype).reshape(1, kv_heads, -1, 1, 1)
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
