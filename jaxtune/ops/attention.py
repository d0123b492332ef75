"""Causal grouped-query attention: the XLA reference, and the dispatch to cuDNN or the Pallas flash kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.ops import dispatch
from jaxtune.ops.context import kv_cache_is_ring, segments_share_prefixes
from jaxtune.ops.sharded import per_batch_shard, per_batch_shard_with
from pallas_kernels.attention_segments import segments_visible, softmax_with_sinks  # the flash kernel's own rules

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    q_offset: jax.Array | int = 0,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Boolean [B or 1, q_len, kv_len]: causal by index (query i sits at q_offset + i), same segment only (or a
    branch's prefix run, inside `ops.context.shared_prefix_segments`). Inside `ops.context.ring_kv_cache` (one
    decoding step on a ring cache) every visible entry is in the past, at distance (q_offset - index) mod kv_len."""
    q_idx = jnp.arange(q_len)[:, None] + q_offset
    kv_idx = jnp.arange(kv_len)[None, :]
    if kv_cache_is_ring():
        if q_len != 1:
            raise ValueError(f"a ring KV cache is read one token at a time, got {q_len} queries")
        mask = jnp.ones((1, 1, kv_len), bool)
        if sliding_window is not None:
            mask = mask & (((q_idx - kv_idx) % kv_len) < sliding_window)[None]
    else:
        mask = (kv_idx <= q_idx)[None]
        if sliding_window is not None:
            mask = mask & ((q_idx - kv_idx) < sliding_window)[None]
    if q_segment_ids is not None:
        kv_seg = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & segments_visible(q_segment_ids[:, :, None], kv_seg[:, None, :], segments_share_prefixes())
    return mask


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
    sliding_window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D] with Hq a multiple of Hkv (kv heads are shared by index, never
    repeated in memory). Query i is at key index q_offset + i (q_offset > 0 when attending to a KV cache).
    Segment ids [B, T] / [B, S] restrict attention to tokens of the same packed sample (each id one
    contiguous run, as packing lays them out). Sinks [Hq] (gpt-oss): one more logit per head in the softmax's
    denominator, attending to nothing. A fast kernel runs where `dispatch` picks one, else XLA.
    """
    fast = _fast_attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, sliding_window, sinks)
    if fast is None:
        fast = _decode_attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, sliding_window, sinks)
    if fast is not None:
        return fast
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    mask = attention_mask(
        t, s, q_offset=q_offset, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        sliding_window=sliding_window,
    )
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = softmax_with_sinks(scores, sinks, hkv).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _decode_attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, sliding_window, sinks) -> jax.Array | None:
    """One decoding step (a single query per row over a KV cache) by the Pallas decode kernel, which reads only the
    cache's filled part, where `dispatch` picks it; None: the reference."""
    if (q.shape[1] != 1 or kv_segment_ids is None or q_segment_ids is None or segments_share_prefixes()
            or dispatch.decode_attention_impl(q.shape[-1], k.shape[1]) != "pallas"):
        return None
    from pallas_kernels.decode_attention import decode_attention

    ring = kv_cache_is_ring()

    def step(q, k, v, q_seg, kv_seg, q_index, sinks):
        return decode_attention(q[:, 0], k, v, q_seg[:, 0], kv_seg, q_index, window=sliding_window, ring=ring,
                                sinks=sinks, interpret=dispatch.interpret())[:, None]

    return per_batch_shard_with(step, (q, k, v, q_segment_ids, kv_segment_ids),
                                (jnp.asarray(q_offset, jnp.int32), sinks))


def _fast_attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, sliding_window,
                    sinks=None) -> jax.Array | None:
    """Flash attention (Pallas) or cuDNN for the full-sequence case, per `dispatch`; None: use the reference.
    Sinks run the Pallas kernel (cuDNN has none)."""
    full_sequence = isinstance(q_offset, int) and q_offset == 0 and kv_segment_ids is None and k.shape[1] == q.shape[1]
    if not full_sequence:
        return None
    plain = (q_segment_ids is None and sliding_window is None and sinks is None
             and q.dtype in (jnp.bfloat16, jnp.float16))
    impl = dispatch.attention_impl(plain_causal=plain and q.shape[1] % 64 == 0, head_dim=q.shape[-1])
    if impl == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        except NotImplementedError:  # a cuDNN without these heads (its version check, at trace time): XLA
            if q.shape[-1] in (64, 128):
                raise
            return None
    if impl == "pallas":
        from pallas_kernels.flash_attention import flash_attention

        shared = q_segment_ids is not None and segments_share_prefixes()

        def flash(q, k, v, *seg):
            return flash_attention(q, k, v, *seg, sliding_window=sliding_window, interpret=dispatch.interpret(),
                                   shared_prefix=shared, sinks=sinks)

        seg = () if q_segment_ids is None else (q_segment_ids,)
        return per_batch_shard(flash, q, k, v, *seg)
    return None
