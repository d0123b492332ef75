"""Attention of one decoding step in Pallas (Triton): each row's query against its KV cache, reading only the
entries the step can see.

XLA's attention of a decoding step reads the whole cache, its empty tail included: at GRPO's 256-token prompts and
512 new tokens a step reads all 768 entries of every row where on average 512 are filled, and the cache of 64 rows
of an 8B model (5 GiB) is as large as its 4-bit weights. Here a program takes one row, one KV head and one split of
the cache, and walks only the blocks below the step's fill (the query's index + 1; with a sliding window, only the
blocks inside it): a trip count known at run time. The query heads that share the KV head are the rows of one
tensor-core product (padded to 16). Each split writes its unnormalized output and softmax statistics; one combine
in XLA sums the splits and the attention sink (gpt-oss), if any.

A ring cache (continuous batching, `jaxtune.rl.continuous`) has no empty tail: every block is read, entries masked by
segment and by their distance (q_index - i) mod S against the window.

Also here: the jnp reference (`decode_attention_reference`), against which interpret mode is tested. Inference only
(no VJP): decoding never differentiates.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)
_ROWS = 16  # a tensor-core product's least rows: the query heads of one KV head, padded


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, q_segment: jax.Array,
                               kv_segments: jax.Array, q_index: jax.Array, *, window: int | None = None,
                               ring: bool = False, sinks: jax.Array | None = None) -> jax.Array:
    """out [B, Hq, D] for queries q [B, Hq, D] at cache index `q_index` (a scalar) over k, v [B, S, Hkv, D]: entry i
    visible where its segment is the query's and i <= q_index (a ring: any i), within `window` of the query
    ((q_index - i) mod S on a ring); `sinks` [Hq]: one more logit per head in the denominator. float32 softmax."""
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scores = jnp.einsum("bkgd,bskd->bkgs", q.reshape(b, hkv, g, d).astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * d**-0.5
    idx = jnp.arange(s)
    distance = (q_index - idx) % s if ring else q_index - idx
    visible = (kv_segments == q_segment[:, None]) & ((distance >= 0) if not ring else True)
    if window is not None:
        visible = visible & (distance < window)
    scores = jnp.where(visible[:, None, None, :], scores, _MASKED)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, g, 1), (b, hkv, g, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), -1)[..., :-1]
    else:
        probs = jax.nn.softmax(scores, -1)
    out = jnp.einsum("bkgs,bskd->bkgd", probs, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, hq, d).astype(q.dtype)


def _kernel(index_ref, qseg_ref, q_ref, k_ref, v_ref, seg_ref, o_ref, m_ref, l_ref, *, block_k: int, split: int,
            length: int, window: int | None, ring: bool, scale: float):
    j = pl.program_id(2)
    q_index = index_ref[0]
    q_seg = qseg_ref[0]
    start = j * split
    stop = jnp.minimum(start + split, length if ring else q_index + 1)  # past the fill nothing is visible
    first = start
    if window is not None and not ring:  # the blocks wholly before the window hold nothing visible
        first = jnp.maximum(start, (q_index - window + 1) // block_k * block_k)
    blocks = jnp.maximum(0, pl.cdiv(stop - first, block_k))
    q = q_ref[...]
    rows, d = q.shape

    def body(t, carry):
        acc, m_prev, l_prev = carry
        k0 = pl.multiple_of(first + t * block_k, block_k)
        k = k_ref[pl.ds(k0, block_k), :]
        v = v_ref[pl.ds(k0, block_k), :]
        seg = seg_ref[pl.ds(k0, block_k)]
        idx = k0 + jnp.arange(block_k)
        distance = (q_index - idx) % length if ring else q_index - idx
        visible = (seg == q_seg) & (distance >= 0)
        if window is not None:
            visible = visible & (distance < window)
        scores = pltriton.dot(q, k, trans_b=True) * scale  # [rows, block_k] float32
        scores = jnp.where(visible[None, :], scores, _MASKED)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        p = jnp.exp(scores - m_next[:, None])
        correction = jnp.exp(m_prev - m_next)
        acc = acc * correction[:, None] + pltriton.dot(p.astype(v.dtype), v)
        return acc, m_next, l_prev * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, blocks, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _block_k(length: int, head_dim: int) -> int:
    block = 32 if head_dim >= 256 else 64
    while block > 16 and length % block:
        block //= 2
    return block


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment: jax.Array, kv_segments: jax.Array,
                     q_index: jax.Array, *, window: int | None = None, ring: bool = False,
                     sinks: jax.Array | None = None, splits: int | None = None, num_warps: int = 4,
                     interpret: bool = False) -> jax.Array:
    """`decode_attention_reference` by the kernel. The cache's length must be a multiple of 16 (the decode path's
    caches are), the head size a power of two >= 16. `splits`: programs per (row, KV head) along the cache (None:
    enough for about two waves on 132 SMs)."""
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    if s % 16 or d < 16 or d & (d - 1):
        raise ValueError(f"decode attention needs a cache length that is a multiple of 16 and a power-of-two head "
                         f"size >= 16, got {s} and {d}")
    g = hq // hkv
    rows = max(_ROWS, pl.next_power_of_2(g))
    bk = _block_k(s, d)
    if splits is None:
        splits = max(1, min(s // bk, -(-264 // (b * hkv))))
    split = -(-s // splits // bk) * bk  # each split a whole number of blocks
    splits = -(-s // split)
    qg = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
    index = jnp.reshape(jnp.asarray(q_index, jnp.int32), (1,))
    per_split = lambda i, h, j: (i, h, j, 0)  # noqa: E731
    o, m, l = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, split=split, length=s, window=window, ring=ring,
                          scale=1.0 / math.sqrt(d)),
        grid=(b, hkv, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h, j: (0,)),
            pl.BlockSpec((1,), lambda i, h, j: (i,)),
            pl.BlockSpec((None, None, rows, d), lambda i, h, j: (i, h, 0, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h, j: (i, 0, h, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h, j: (i, 0, h, 0)),
            pl.BlockSpec((None, s), lambda i, h, j: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, d), lambda i, h, j: (i, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, rows), per_split),
            pl.BlockSpec((None, None, None, rows), per_split),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, hkv, splits, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32),
                   jax.ShapeDtypeStruct((b, hkv, splits, rows), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(index, q_segment.astype(jnp.int32), qg, k, v, kv_segments.astype(jnp.int32))
    o, m, l = o[:, :, :, :g], m[:, :, :, :g], l[:, :, :, :g]
    top = jnp.max(m, axis=2)  # [b, hkv, g]
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, g), top.shape)
        top = jnp.maximum(top, sink)
    weight = jnp.exp(m - top[:, :, None])  # [b, hkv, splits, g]; a split that saw nothing has l = 0
    total = jnp.sum(weight * l, axis=2)
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    out = jnp.sum(weight[..., None] * o, axis=2) / jnp.maximum(total, 1e-30)[..., None]
    return out.reshape(b, hq, d).astype(q.dtype)
