"""The one dispatch point for the model's heavy ops (projections and attention).

Every matmul and attention call of the model goes through here, so faster backends (Pallas kernels)
plug in without touching the model. The implementations below are the XLA reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def _zero_cotangent(a: jax.Array) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, dtype=jax.dtypes.float0)
    return jnp.zeros_like(a)


@jax.custom_vjp
def _nf4_matmul(x: jax.Array, weight) -> jax.Array:
    from jaxtune.nf4 import dequantize

    return linear(x, dequantize(weight, x.dtype))


def _nf4_matmul_fwd(x, weight):
    # keep only the 4-bit arrays for the backward pass, never the dequantized bf16 copy of W
    return _nf4_matmul(x, weight), weight


def _nf4_matmul_bwd(weight, dy):
    from jaxtune.nf4 import dequantize

    w = dequantize(weight, dy.dtype)  # [out, in]
    dx = jax.lax.dot_general(dy, w, (((dy.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.astype(dy.dtype), jax.tree.map(_zero_cotangent, weight)


_nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


def nf4_linear(x: jax.Array, weight, bias: jax.Array | None = None) -> jax.Array:
    """y = x @ dequant(W).T (+ bias) for a frozen NF4 weight [out, in].

    XLA reference: dequantize then dot; its VJP gives dx = dy @ dequant(W) only (W is frozen) and saves
    just the 4-bit arrays for the backward pass, re-dequantizing there.
    """
    y = _nf4_matmul(x, weight)
    return y if bias is None else (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
