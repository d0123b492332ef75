"""The one dispatch point for the model's heavy ops (projections and attention).

Every matmul and attention call of the model goes through here, so faster backends (Pallas kernels)
plug in without touching the model. The implementations below are the XLA reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def linear(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """y = x @ weight.T (+ bias) for an HF-layout weight [out, in]; f32 accumulation, x's dtype out."""
    y = jax.lax.dot_general(
        x, weight.astype(x.dtype), (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype or x.dtype)


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    q_offset: jax.Array | int = 0,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Boolean [B or 1, q_len, kv_len]: causal by index (query i sits at q_offset + i), same segment only."""
    q_idx = jnp.arange(q_len)[:, None] + q_offset
    kv_idx = jnp.arange(kv_len)[None, :]
    mask = (kv_idx <= q_idx)[None]
    if sliding_window is not None:
        mask = mask & ((q_idx - kv_idx) < sliding_window)[None]
    if q_segment_ids is not None:
        kv_seg = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (q_segment_ids[:, :, None] == kv_seg[:, None, :])
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
) -> jax.Array:
    """Causal grouped-query attention, XLA reference.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D] with Hq a multiple of Hkv (kv heads are shared by index, never
    repeated in memory). Query i is at key index q_offset + i (q_offset > 0 when attending to a KV cache).
    Segment ids [B, T] / [B, S] restrict attention to tokens of the same packed sample.
    """
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
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def nf4_linear(x: jax.Array, weight, bias: jax.Array | None = None) -> jax.Array:
    """y = x @ dequant(W).T (+ bias) for an NF4 weight [out, in]; XLA reference: dequantize, then dot."""
    from jaxtune.nf4 import dequantize

    return linear(x, dequantize(weight, x.dtype), bias)
