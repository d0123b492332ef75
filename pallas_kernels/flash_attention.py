"""Flash attention for GPU in Pallas (Triton): forward and backward, causal, GQA, packed segments.

Layout is the model's own: q [B, T, Hq, D], k and v [B, T, Hkv, D] with Hq a multiple of Hkv. A query
head reads its kv head through the BlockSpec index map (h // group), so K/V are never repeated in HBM.
Segment ids [B, T] restrict attention to the same packed sample; each id must form one contiguous run
(as sample packing produces). Per query tile the kernel starts its key loop at the first key of the
tile's earliest segment, so fully masked tiles are never visited and no [T, T] mask exists anywhere.
Any T works: the wrapper pads to the tile size and the padding is its own segment.

Shared prefixes (`shared_prefix=True`, for preference pairs: one prompt, two responses in one row): a negative
segment id s marks a branch that sees, besides its own run, the run of id (-s) // 2, which lies before it (the
prompt run p, its branches -2p and -2p-1). Prefix ids are positive and below T. A query tile then loops over
the key tiles of its prompt run and of its own runs, skipping those between (the other branch); a prefix key's
tile runs to its last branch.

Softmax runs in base 2 (exp2 with log2(e) folded into the scale); the saved residual is the per-row
log-sum-exp in that base. The backward pass is two kernels (dq; dk+dv) so no atomics are needed. With
GQA, dk/dv are produced per query head in f32 and summed over the group outside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention_segments import (prefix_gap, prefix_ids, segments_visible, softmax_with_sinks,
                                               visible_bounds)

_LOG2E = math.log2(math.e)
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class AttentionTiles:
    """Tile sizes and Triton launch parameters (powers of two), forward and the two backward kernels."""

    block_q: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 2
    bwd_block_q: int = 64
    bwd_block_k: int = 64
    bwd_num_warps: int = 4
    bwd_num_stages: int = 2

    def fitted(self, t: int, itemsize: int = 2) -> "AttentionTiles":
        """Shrink tiles for short sequences (tensor-core dots need >= 16 rows) and for float32 inputs: the
        forward's 128 x 128 tiles of 4-byte keys and values in two pipeline stages ask 257 KB of shared memory at
        head dim 128, past the 227 KB an H100 has (measured on an H200)."""
        cap = max(16, pl.next_power_of_2(t))
        if itemsize >= 4:
            cap = min(cap, 64)
        return dataclasses.replace(
            self,
            block_q=min(self.block_q, cap),
            block_k=min(self.block_k, cap),
            bwd_block_q=min(self.bwd_block_q, cap),
            bwd_block_k=min(self.bwd_block_k, cap),
        )


DEFAULT_TILES = AttentionTiles()
# heads wider than 128 (Qwen3.5's and Gemma 4's sliding layers: 256; Gemma 4's full layers: 512): tiles shrunk so the
# accumulators fit the registers and the key and value tiles with the query tile fit shared memory in the stages asked;
# the fastest of a sweep on an H200 at 2048 tokens (benchmarks/results/2026-12-07-wide-heads-and-gpt-oss-h200.md)
WIDE_TILES = {256: AttentionTiles(64, 64, 8, 2, 32, 32, 8, 1), 512: AttentionTiles(64, 64, 8, 1, 32, 32, 8, 1)}
HEAD_DIMS = (64, 128, *WIDE_TILES)


def tiles_for(head_dim: int, tiles: AttentionTiles = DEFAULT_TILES) -> AttentionTiles:
    """The tiles a head size runs: those asked for, or for wide heads the default's shrunk counterpart."""
    return WIDE_TILES[head_dim] if tiles == DEFAULT_TILES and head_dim in WIDE_TILES else tiles


# --------------------------------------------------------------------------------------------- reference


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
    shared_prefix: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Pure-jnp attention with the kernel's semantics (builds the [T, T] mask; for tests and CPU)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.ones((1, t, t), bool)
    idx = jnp.arange(t)
    if causal:
        mask = mask & (idx[None, :, None] >= idx[None, None, :])
    if sliding_window is not None:
        mask = mask & ((idx[None, :, None] - idx[None, None, :]) < sliding_window)
    if segment_ids is not None:
        mask = mask & segments_visible(segment_ids[:, :, None], segment_ids[:, None, :], shared_prefix)
    s = jnp.where(mask[:, None, None], s, _MASKED)
    p = softmax_with_sinks(s, sinks, hkv)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype) if v.dtype != jnp.float64 else p, v,
                     preferred_element_type=jnp.float32 if v.dtype != jnp.float64 else None)
    return out.reshape(b, t, hq, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------ shared pieces


def _tile_mask(q_pos, k_pos, q_seg, k_seg, causal: bool, window: int | None, q_pre=None):
    """[len(q_pos), len(k_pos)] visibility of keys to queries inside one tile, or None if all visible; `q_pre`:
    the queries' prefix ids (shared prefixes)."""
    mask = None

    def both(a, b):
        return b if a is None else a & b

    if causal:
        mask = both(mask, q_pos[:, None] >= k_pos[None, :])
    if window is not None:
        mask = both(mask, (q_pos[:, None] - k_pos[None, :]) < window)
    if q_seg is not None:
        same = q_seg[:, None] == k_seg[None, :]
        mask = both(mask, same if q_pre is None else same | (q_pre[:, None] == k_seg[None, :]))
    return mask


def _key_tile_range(i, block_q, block_k, n_k, causal, window, q_start_min):
    """Key tiles [lo, hi) that query tile i can see; tiles outside hold no visible key."""
    hi = jnp.minimum(pl.cdiv((i + 1) * block_q, block_k), n_k) if causal else n_k
    lo = 0
    if q_start_min is not None:
        lo = q_start_min // block_k
    if window is not None:
        lo = jnp.maximum(lo, jnp.maximum(i * block_q - window + 1, 0) // block_k)
    return lo, hi


def _query_tile_range(j, block_q, block_k, n_q, causal, window, k_end_max):
    """Query tiles [lo, hi) that can see key tile j."""
    lo = (j * block_k) // block_q if causal else 0
    hi = n_q
    if k_end_max is not None:
        hi = jnp.minimum(hi, k_end_max // block_q + 1)
    if window is not None:
        hi = jnp.minimum(hi, (j * block_k + block_k - 1 + window - 1) // block_q + 1)
    return lo, hi


def _query_segment_specs(bq: int, t: int, shared_prefix: bool) -> list:
    """Block specs of the query-side segment operands of the forward and dq kernels: the tile's segment ids,
    (its prefix ids,) its first visible key, (its own run's start and its prefix run's end,) and the whole row's
    segment ids for the keys."""
    tile = pl.BlockSpec((None, bq), lambda i, bi, h: (bi, i))
    return [tile] * (5 if shared_prefix else 2) + [pl.BlockSpec((None, t), lambda i, bi, h: (bi, 0))]


def _query_segment_args(segment_ids: jax.Array, shared_prefix: bool) -> list:
    start, _ = visible_bounds(segment_ids, shared_prefix)
    if not shared_prefix:
        return [segment_ids, start, segment_ids]
    own_start, prefix_end = prefix_gap(segment_ids)
    return [segment_ids, prefix_ids(segment_ids), start, own_start, prefix_end, segment_ids]


def _skipped_key_tiles(q_own_ref, q_pend_ref, block_k):
    """Key tiles [lo, hi) no query of this tile can see: after every prefix run it reads, before its own runs."""
    return pl.cdiv(jnp.max(q_pend_ref[...]) + 1, block_k), jnp.min(q_own_ref[...]) // block_k


def _key_loops(lo, hi, gap):
    """The key-tile ranges a query tile visits: [lo, hi), less the skipped tiles `gap` (shared prefixes)."""
    if gap is None:
        return ((lo, hi),)
    gap_lo, gap_hi = gap
    return ((lo, jnp.minimum(jnp.minimum(gap_lo, gap_hi), hi)), (jnp.maximum(gap_hi, lo), hi))


def _query_tile_plan(refs, n_out, i, n_k, *, block_q, block_k, causal, window, has_segments, shared_prefix):
    """What a query tile's kernel (forward, dq) needs from its segment operands: the mask of key tile j (None:
    all visible), the key-tile loops to run as (start, stop, masked), and its output refs (the last `n_out`)."""
    seg_refs, out_refs = refs[:len(refs) - n_out], refs[len(refs) - n_out:]
    q_pos = i * block_q + jnp.arange(block_q)
    q_seg = k_seg_ref = q_pre = gap = q_start = None
    if shared_prefix:
        q_seg_ref, q_pre_ref, q_start_ref, q_own_ref, q_pend_ref, k_seg_ref = seg_refs
        q_pre, gap = q_pre_ref[...], _skipped_key_tiles(q_own_ref, q_pend_ref, block_k)
    elif has_segments:
        q_seg_ref, q_start_ref, k_seg_ref = seg_refs
    if has_segments:
        q_seg, q_start = q_seg_ref[...], jnp.min(q_start_ref[...])
    lo, hi = _key_tile_range(i, block_q, block_k, n_k, causal, window, q_start)
    if causal and not has_segments and window is None:
        # tiles wholly below the diagonal need no mask; only the diagonal band does
        mid = jnp.minimum((i * block_q + 1) // block_k, hi)
        loops = ((lo, mid, False), (mid, hi, True))
    else:
        masked = causal or has_segments or window is not None
        loops = tuple((start, stop, masked) for start, stop in _key_loops(lo, hi, gap))

    def tile_mask(j):
        k_pos = j * block_k + jnp.arange(block_k)
        k_seg = None if k_seg_ref is None else k_seg_ref[pl.ds(j * block_k, block_k)]
        return _tile_mask(q_pos, k_pos, q_seg, k_seg, causal, window, q_pre)

    return tile_mask, loops, out_refs


# ------------------------------------------------------------------------------------------------ forward


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, qk_scale, causal, window, block_q, block_k, has_segments,
                shared_prefix=False, has_sinks=False):
    i = pl.program_id(0)
    n_k = k_ref.shape[0] // block_k
    sink_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    tile_mask, loops, (o_ref, lse_ref) = _query_tile_plan(
        refs, 2, i, n_k, block_q=block_q, block_k=block_k, causal=causal, window=window, has_segments=has_segments,
        shared_prefix=shared_prefix)
    d = q_ref.shape[-1]
    q = q_ref[...]

    def step(j, carry, masked):
        acc, m, l = carry
        ks = pl.ds(j * block_k, block_k)
        k = k_ref[ks, :]
        s = pltriton.dot(q, k, trans_b=True) * qk_scale
        if masked:
            s = jnp.where(tile_mask(j), s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        v = v_ref[ks, :]
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v)
        return acc, m_new, l

    # the online softmax starts from the sink's logit (log2 units) where there is one: it joins every row's
    # normalizer and the log-sum-exp the backward reads, and attends to nothing
    carry = (
        jnp.zeros((block_q, d), jnp.float32),
        sink_ref[...] if has_sinks else jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.ones((block_q,), jnp.float32) if has_sinks else jnp.zeros((block_q,), jnp.float32),
    )
    for start, stop, masked in loops:
        carry = jax.lax.fori_loop(start, stop, functools.partial(step, masked=masked), carry)
    acc, m, l = carry
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _forward(q, k, v, segment_ids, *, scale, causal, window, tiles: AttentionTiles, interpret, shared_prefix=False,
             sinks=None):
    """Padded inputs -> (out [B, Tp, Hq, D], lse [B, Hq, Tp] in log2 units); sinks [Hq] or None."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    bq, bk = tiles.block_q, tiles.block_k
    has_segments = segment_ids is not None
    kernel = functools.partial(
        _fwd_kernel, qk_scale=scale * _LOG2E, causal=causal, window=window, block_q=bq, block_k=bk,
        has_segments=has_segments, shared_prefix=shared_prefix, has_sinks=sinks is not None,
    )
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),
        pl.BlockSpec((None, t, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
        pl.BlockSpec((None, t, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
    ]
    args = [q, k, v]
    if sinks is not None:  # each head's sink logit in log2 units, as a row of the query tile's length
        in_specs.append(pl.BlockSpec((None, bq), lambda i, bi, h: (h, i)))
        args.append(jnp.broadcast_to((sinks.astype(jnp.float32) * _LOG2E)[:, None], (hq, t)))
    if has_segments:
        in_specs += _query_segment_specs(bq, t, shared_prefix)
        args += _query_segment_args(segment_ids, shared_prefix)
    out, lse = pl.pallas_call(
        kernel,
        grid=(t // bq, b, hq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, t), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="flash_attention_fwd",
    )(*args)
    return out, lse


# ----------------------------------------------------------------------------------------------- backward


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, qk_scale, scale, causal, window,
               block_q, block_k, has_segments, shared_prefix=False):
    i = pl.program_id(0)
    n_k = k_ref.shape[0] // block_k
    tile_mask, loops, (dq_ref,) = _query_tile_plan(
        refs, 1, i, n_k, block_q=block_q, block_k=block_k, causal=causal, window=window, has_segments=has_segments,
        shared_prefix=shared_prefix)
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...]
    delta = delta_ref[...]

    def step(j, dq, masked):
        ks = pl.ds(j * block_k, block_k)
        k = k_ref[ks, :]
        v = v_ref[ks, :]
        s = pltriton.dot(q, k, trans_b=True) * qk_scale
        if masked:
            s = jnp.where(tile_mask(j), s, _MASKED)
        p = jnp.exp2(s - lse[:, None])
        dp = pltriton.dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + pltriton.dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, jnp.float32)
    for start, stop, masked in loops:
        dq = jax.lax.fori_loop(start, stop, functools.partial(step, masked=masked), dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, qk_scale, scale, causal, window,
                block_q, block_k, has_segments, heads, shared_prefix=False):
    """dk, dv of one key tile. With `heads` > 0 the program owns a kv head and sums over the `heads` query
    heads that share it (q/do refs [T, heads, D], lse/delta [heads, T]); else one query head's share."""
    q_pre_ref = None
    if shared_prefix:
        q_seg_ref, q_pre_ref, k_seg_ref, k_end_ref, dk_ref, dv_ref = refs
    elif has_segments:
        q_seg_ref, k_seg_ref, k_end_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    j = pl.program_id(0)
    n_q = q_ref.shape[0] // block_q
    k = k_ref[...]
    v = v_ref[...]
    k_pos = j * block_k + jnp.arange(block_k)
    k_seg = k_seg_ref[...] if has_segments else None
    lo, hi = _query_tile_range(
        j, block_q, block_k, n_q, causal, window, jnp.max(k_end_ref[...]) if has_segments else None
    )

    def step(i, carry, masked, head=None):
        dk, dv = carry
        qs = pl.ds(i * block_q, block_q)
        if head is None:
            q, do, lse, delta = q_ref[qs, :], do_ref[qs, :], lse_ref[qs], delta_ref[qs]
        else:
            q, do = q_ref[qs, head, :], do_ref[qs, head, :]
            lse, delta = lse_ref[head, qs], delta_ref[head, qs]
        st = pltriton.dot(k, q, trans_b=True) * qk_scale  # [bk, bq]
        if masked:
            q_pos = i * block_q + jnp.arange(block_q)
            mask = _tile_mask(q_pos, k_pos, q_seg_ref[qs] if has_segments else None, k_seg, causal, window,
                              None if q_pre_ref is None else q_pre_ref[qs])
            st = jnp.where(mask.T, st, _MASKED)
        pt = jnp.exp2(st - lse[None, :])
        dv = dv + pltriton.dot(pt.astype(do.dtype), do)
        dpt = pltriton.dot(v, do, trans_b=True)
        dst = pt * (dpt - delta[None, :])
        dk = dk + pltriton.dot(dst.astype(q.dtype), q)
        return dk, dv

    if causal and not has_segments and window is None:
        # query tiles wholly below the diagonal see every key of this tile: [lo, mid) masked, [mid, hi) not
        mid = jnp.maximum(jnp.minimum(pl.cdiv(j * block_k + block_k - 1, block_q), hi), lo)
        ranges = ((lo, mid, True), (mid, hi, False))
    else:
        ranges = ((lo, hi, causal or has_segments or window is not None),)
    carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for head in range(heads) if heads else (None,):
        for start, stop, masked in ranges:
            carry = jax.lax.fori_loop(start, stop, functools.partial(step, masked=masked, head=head), carry)
    dk, dv = carry
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, segment_ids, out, lse, do, *, scale, causal, window, tiles: AttentionTiles,
              interpret, shared_prefix=False):
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    bq, bk = tiles.bwd_block_q, tiles.bwd_block_k
    has_segments = segment_ids is not None
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), do.astype(jnp.float32))
    params = pltriton.CompilerParams(num_warps=tiles.bwd_num_warps, num_stages=tiles.bwd_num_stages)
    static = dict(qk_scale=scale * _LOG2E, scale=scale, causal=causal, window=window, block_q=bq,
                  block_k=bk, has_segments=has_segments, shared_prefix=shared_prefix)

    # dq: one program per (query tile, batch, query head), looping over key tiles
    in_specs = [
        pl.BlockSpec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),
        pl.BlockSpec((None, t, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
        pl.BlockSpec((None, t, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
        pl.BlockSpec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),
        pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i)),
        pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i)),
    ]
    args = [q, k, v, do, lse, delta]
    if has_segments:
        in_specs += _query_segment_specs(bq, t, shared_prefix)
        args += _query_segment_args(segment_ids, shared_prefix)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **static),
        grid=(t // bq, b, hq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), lambda i, bi, h: (bi, i, h, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dq",
    )(*args)

    # dk, dv: one program per (key tile, batch, kv head) summing over its query heads when the group is a
    # power of two (a Triton block); else per query head, with f32 partials summed over the group after
    grouped = group > 1 and group & (group - 1) == 0
    partials = group > 1 and not grouped
    head_block = group if grouped else None  # query heads per program (None: one, dimension squeezed)
    kv_head = (lambda h: h // group) if partials else (lambda h: h)
    in_specs = [
        pl.BlockSpec((None, t, head_block, d), lambda j, bi, h: (bi, 0, h, 0)),
        pl.BlockSpec((None, bk, None, d), lambda j, bi, h: (bi, j, kv_head(h), 0)),
        pl.BlockSpec((None, bk, None, d), lambda j, bi, h: (bi, j, kv_head(h), 0)),
        pl.BlockSpec((None, t, head_block, d), lambda j, bi, h: (bi, 0, h, 0)),
        pl.BlockSpec((None, head_block, t), lambda j, bi, h: (bi, h, 0)),
        pl.BlockSpec((None, head_block, t), lambda j, bi, h: (bi, h, 0)),
    ]
    args = [q, k, v, do, lse, delta]
    if has_segments:
        _, end = visible_bounds(segment_ids, shared_prefix)
        full = pl.BlockSpec((None, t), lambda j, bi, h: (bi, 0))
        in_specs += [full] * (2 if shared_prefix else 1) + [
            pl.BlockSpec((None, bk), lambda j, bi, h: (bi, j)),
            pl.BlockSpec((None, bk), lambda j, bi, h: (bi, j)),
        ]
        args += [segment_ids] + ([prefix_ids(segment_ids)] if shared_prefix else []) + [segment_ids, end]
    out_heads, kv_dtype = (hq, jnp.float32) if partials else (hkv, k.dtype)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, heads=group if grouped else 0, **static),
        grid=(t // bk, b, out_heads),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bk, None, d), lambda j, bi, h: (bi, j, h, 0)),
            pl.BlockSpec((None, bk, None, d), lambda j, bi, h: (bi, j, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, t, out_heads, d), kv_dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
        name="flash_attention_dkv",
    )(*args)
    if partials:
        dk = dk.reshape(b, t, hkv, group, d).sum(axis=3)
        dv = dv.reshape(b, t, hkv, group, d).sum(axis=3)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


# ------------------------------------------------------------------------------------------ public entry


def _check(q, k, v, segment_ids):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"flash_attention wants q [B,T,Hq,D], k=v [B,T,Hkv,D]; got {q.shape}, {k.shape}, {v.shape}")
    b, t, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != t or k.shape[3] != d:
        raise ValueError(f"flash_attention: q {q.shape} and k/v {k.shape} differ in batch, length or head dim")
    if hq % k.shape[2]:
        raise ValueError(f"flash_attention: {hq} query heads is not a multiple of {k.shape[2]} kv heads")
    if d not in HEAD_DIMS:
        raise ValueError(f"flash_attention supports head_dim {', '.join(map(str, HEAD_DIMS))}, got {d}; use the XLA "
                         "reference")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"flash_attention: segment_ids must be [B, T] = {(b, t)}, got {segment_ids.shape}")


def _pad_to(x, t_pad, axis):
    pad = t_pad - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _prepare(q, k, v, segment_ids, causal, tiles, shared_prefix=False):
    t = q.shape[1]
    tiles = tiles.fitted(t, jnp.dtype(q.dtype).itemsize)
    step = max(tiles.block_q, tiles.block_k, tiles.bwd_block_q, tiles.bwd_block_k)
    t_pad = pl.cdiv(t, step) * step
    if t_pad != t:
        if segment_ids is not None:
            # padding is a run of its own, distinct from its neighbour (and, with shared prefixes, no branch)
            pad_id = jnp.max(segment_ids) + 1 if shared_prefix else jnp.min(segment_ids) - 1
            segment_ids = jnp.concatenate(
                [segment_ids, jnp.broadcast_to(pad_id, (segment_ids.shape[0], t_pad - t)).astype(segment_ids.dtype)],
                axis=1,
            )
        elif not causal:
            segment_ids = jnp.concatenate(
                [jnp.zeros((q.shape[0], t), jnp.int32), jnp.ones((q.shape[0], t_pad - t), jnp.int32)], axis=1
            )
        q, k, v = (_pad_to(a, t_pad, 1) for a in (q, k, v))
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    return q, k, v, segment_ids, tiles


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _flash(q, k, v, segment_ids, sinks, scale, causal, window, tiles, interpret, shared_prefix):
    t = q.shape[1]
    qp, kp, vp, seg, tl = _prepare(q, k, v, segment_ids, causal, tiles, shared_prefix)
    out, _ = _forward(qp, kp, vp, seg, scale=scale, causal=causal, window=window, tiles=tl, interpret=interpret,
                      shared_prefix=shared_prefix, sinks=sinks)
    return out[:, :t]


def _flash_fwd(q, k, v, segment_ids, sinks, scale, causal, window, tiles, interpret, shared_prefix):
    t = q.shape[1]
    qp, kp, vp, seg, tl = _prepare(q, k, v, segment_ids, causal, tiles, shared_prefix)
    out, lse = _forward(qp, kp, vp, seg, scale=scale, causal=causal, window=window, tiles=tl, interpret=interpret,
                        shared_prefix=shared_prefix, sinks=sinks)
    # named so a selective remat policy can keep them rather than re-running the forward kernel
    out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (out if out.shape[1] == t else out[:, :t]), (q, k, v, segment_ids, sinks, out, lse)


def _flash_bwd(scale, causal, window, tiles, interpret, shared_prefix, residuals, do):
    """The kernels' dq, dk, dv read the log-sum-exp, which holds the sink: they need nothing else for it. The
    sink's own gradient is -sum_i P_sink,i * delta_i (it has no value: dP_sink = 0), summed over rows and batch."""
    q, k, v, segment_ids, sinks, out_p, lse = residuals
    t = q.shape[1]
    qp, kp, vp, seg, tl = _prepare(q, k, v, segment_ids, causal, tiles, shared_prefix)
    dop = _pad_to(do, qp.shape[1], 1)
    dq, dk, dv = _backward(
        qp, kp, vp, seg, out_p, lse, dop, scale=scale, causal=causal, window=window, tiles=tl, interpret=interpret,
        shared_prefix=shared_prefix,
    )
    dsinks = None
    if sinks is not None:
        delta = jnp.einsum("bthd,bthd->bht", out_p[:, :t].astype(jnp.float32), do.astype(jnp.float32))
        p_sink = jnp.exp2(sinks.astype(jnp.float32)[None, :, None] * _LOG2E - lse[:, :, :t])
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    return dq[:, :t], dk[:, :t], dv[:, :t], None, dsinks


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    scale: float | None = None,
    tiles: AttentionTiles = DEFAULT_TILES,
    interpret: bool = False,
    shared_prefix: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(q kᵀ·scale + mask) v over [B, T, H, D] tensors, differentiable in q, k and v (and `sinks`).

    `segment_ids` [B, T] (each id one contiguous run) keeps attention inside a packed sample;
    `shared_prefix` lets negative ids see their prefix run (module docstring); `sliding_window` w lets a query
    see only the last w keys (Mistral); `sinks` [Hq] (gpt-oss) adds a logit per query head to the softmax's
    normalizer that attends to nothing. `interpret=True` runs the kernels' logic on CPU.
    """
    _check(q, k, v, segment_ids)
    if shared_prefix and (segment_ids is None or not causal):
        raise ValueError("flash_attention: shared_prefix needs segment_ids and causal attention")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if sinks is not None and sinks.shape != (q.shape[2],):
        raise ValueError(f"flash_attention: sinks has shape {sinks.shape}, not one per query head ({q.shape[2]},)")
    return _flash(q, k, v, segment_ids, sinks, scale, causal, sliding_window, tiles_for(q.shape[-1], tiles), interpret,
                  shared_prefix)
