"""llama.cpp's K-quants (q4_K, q5_K, q6_K) in numpy: the blocks a Q4_K_M GGUF is made of.

A super-block is 256 weights of a row. q4_K splits it into 8 blocks of 32, each with a 6-bit scale and a 6-bit
minimum (w = d * sc * q - dmin * m, q in 0..15, d and dmin f16 per super-block); q5_K likewise with q in 0..31
(the fifth bits stored apart); q6_K into 16 blocks of 16 with an 8-bit scale (w = d * sc * (q - 32), q in 0..63).
The scale search is ggml's reference quantizer (`quantize_row_q4_K_ref` / `_q5_K_ref` / `_q6_K_ref`, what
`llama-quantize` runs without an importance matrix),
computed over all blocks at once with float32 sums taken in ggml's order, so the bytes are ggml's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K = 256  # weights per super-block
Q4_K_BYTES = 2 + 2 + 12 + QK_K // 2  # d, dmin, 6-bit scales and mins, 4-bit codes
Q5_K_BYTES = 2 + 2 + 12 + QK_K // 8 + QK_K // 2  # d, dmin, 6-bit scales and mins, fifth bits, low 4 bits
Q6_K_BYTES = QK_K // 2 + QK_K // 4 + QK_K // 16 + 2  # low 4 bits, high 2 bits, int8 scales, d
_EPS = np.float32(1e-15)  # ggml's GROUP_MAX_EPS: a block below it is all zeros
_CHUNK = 1 << 18  # weights quantized at once by one thread (measured fastest of 2^14..2^20: the arrays stay in cache)
f32 = np.float32


def _nearest(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: round half to even, as an integer."""
    return np.rint(v).astype(np.int32)


def _ordered_sum(terms: np.ndarray) -> np.ndarray:
    """sum over the first axis in float32, in order from 0 (a C loop's rounding, not numpy's pairwise one)."""
    acc = np.zeros(terms.shape[1:], f32)
    for term in terms:
        acc += term
    return acc


def _scale_and_min(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's make_qkx2_quants over the columns of x [n, B] with weights w: (scale, -min, codes) of the asymmetric
    grid scale * q + min (min <= 0) with the least weighted squared error among nstep + 1 trial scales. Blocks are
    columns so that every sum runs over contiguous rows."""
    mn = np.minimum(x.min(0), f32(0))
    mx = x.max(0)
    sum_w = _ordered_sum(w)
    sum_x = _ordered_sum(w * x)
    flat = mx == mn
    iscale = f32(nmax) / np.where(flat, f32(1), mx - mn)
    scale = f32(1) / iscale
    codes = np.clip(_nearest(iscale * (x - mn)), 0, nmax)
    best = _ordered_sum(w * np.square(scale * codes.astype(f32) + mn - x))
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):  # each trial grid starts from the best minimum so far, as ggml's loop does
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / np.where(flat, f32(1), mx - mn)
            trial = np.clip(_nearest(iscale * (x - mn)), 0, nmax)
            lf = trial.astype(f32)
            wl = w * lf
            sum_l, sum_l2, sum_xl = _ordered_sum(wl), _ordered_sum(wl * lf), _ordered_sum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_min > 0
            this_scale = np.where(positive, sum_xl / sum_l2, this_scale)
            this_min = np.where(positive, f32(0), this_min)
            err = _ordered_sum(w * np.square(this_scale * lf + this_min - x))
            better = (det > 0) & (err < best) & ~flat
            codes = np.where(better, trial, codes)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    codes = np.where(flat, 0, codes)
    return np.where(flat, f32(0), scale), -mn, codes


def _symmetric_scale(x: np.ndarray, nmax: int, w: np.ndarray | None = None):
    """ggml's make_qx_quants with rmse_type 1 over the columns of x [n, B]: (scale, codes + nmax) of the grid
    scale * q, q in -nmax..nmax-1, the best of 19 trial scales by the error weighted by w (default x^2)."""
    first = np.argmax(np.abs(x), axis=0)
    peak = np.take_along_axis(x, first[None], axis=0)[0]
    zero = np.abs(peak) < _EPS
    peak = np.where(zero, f32(1), peak)
    w = x * x if w is None else w

    def trial(iscale):
        q = np.clip(_nearest(iscale * x), -nmax, nmax - 1)
        qf = q.astype(f32)
        return q, _ordered_sum(w * x * qf), _ordered_sum(w * qf * qf)

    codes, sumlx, suml2 = trial(f32(-nmax) / peak)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
        best = scale * sumlx
        for step in (*range(-9, 0), *range(1, 10)):
            q, sumlx, suml2 = trial(-(f32(nmax) + f32(0.1) * f32(step)) / peak)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            codes = np.where(better, q, codes)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    return np.where(zero, f32(0), scale), np.where(zero, 0, codes + nmax)


def _f16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


def _super_blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    if w.shape[-1] % QK_K:
        raise ValueError(f"{fmt} quantizes rows of whole {QK_K}-weight super-blocks; a row has {w.shape[-1]} weights")
    return np.ascontiguousarray(w, f32).reshape(-1, QK_K)


def _in_chunks(w: np.ndarray, fmt: str, fn, nbytes: int) -> np.ndarray:
    """fn over the super-blocks of w, a chunk per task on every core (numpy releases the GIL)."""
    x = _super_blocks(w, fmt)
    step = _CHUNK // QK_K
    chunks = [x[i:i + step] for i in range(0, len(x), step)]
    with ThreadPoolExecutor(max_workers=min(len(chunks), os.cpu_count() or 1) or 1) as pool:
        out = np.concatenate(list(pool.map(fn, chunks))) if chunks else np.zeros((0, nbytes), np.uint8)
    return out.reshape(*w.shape[:-1], w.shape[-1] // QK_K * nbytes)


def _asymmetric_blocks(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """q4_K's and q5_K's shared part: each 32-weight block's scale and minimum by make_qkx2_quants (weights
    av_x + |x|), both quantized to 6 bits against the super-block's f16 d and dmin, and the codes 0..nmax
    recomputed from the stored ones. (d, dmin as f16 [n], the 12 packed scale bytes [n, 12], codes [n, 8, 32])."""
    blocks = x.reshape(-1, 8, 32)
    columns = np.ascontiguousarray(blocks.reshape(-1, 32).T)  # [32, blocks]
    av_x = np.sqrt(_ordered_sum(columns * columns) / f32(32))
    scales, mins, codes = _scale_and_min(columns, av_x + np.abs(columns), nmax, rmin, 0.1, nstep)
    scales, mins, codes = scales.reshape(-1, 8), mins.reshape(-1, 8), codes.T.reshape(-1, 8, 32)
    max_scale = np.maximum(scales.max(-1), f32(0))
    max_min = np.maximum(mins.max(-1), f32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0))
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0))
    ls = np.minimum(_nearest(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # a uint8 store, then MIN
    lm = np.minimum(_nearest(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    d, dmin = _f16(max_scale / f32(63)), _f16(max_min / f32(63))
    return _packed_scales(blocks, ls, lm, d, dmin, codes, nmax)


def _packed_scales(blocks: np.ndarray, ls: np.ndarray, lm: np.ndarray, d: np.ndarray, dmin: np.ndarray,
                   codes: np.ndarray, nmax: int):
    """The 6-bit scales ls and minimums lm [n, 8] packed into q4_K's / q5_K's 12 bytes, and each block's codes
    recomputed from the stored scale and minimum (kept where the stored scale is zero): (d, dmin, packed, codes)."""
    packed = np.zeros((len(blocks), 12), np.uint8)
    packed[:, 0:4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    ls, lm = ls & 63, lm & 63  # what the stored 6 bits read back as
    step = d.astype(f32)[:, None] * ls.astype(f32)
    offset = dmin.astype(f32)[:, None] * lm.astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest((blocks + offset[..., None]) / step[..., None]), 0, nmax)
    codes = np.where((step != 0)[..., None], requant, codes).astype(np.uint8)
    return d, dmin, packed, codes


def _low_nibbles(codes: np.ndarray) -> np.ndarray:
    """The codes' low 4 bits as q4_K / q5_K store them: blocks 2c and 2c + 1 share 32 bytes, low and high nibble."""
    low = (codes & 0xF).reshape(-1, 4, 2, 32)
    return (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k_blocks(x: np.ndarray) -> np.ndarray:
    return q4_k_bytes(*_asymmetric_blocks(x, 15, -1.0, 20))


def q4_k_bytes(d: np.ndarray, dmin: np.ndarray, packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """q4_K super-blocks' bytes from their f16 d and dmin, 12 packed scale bytes and codes [n, 8, 32]."""
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, _low_nibbles(codes)],
                          axis=1)


def _q5_k_blocks(x: np.ndarray) -> np.ndarray:
    return q5_k_bytes(*_asymmetric_blocks(x, 31, -0.5, 15))


def q5_k_bytes(d: np.ndarray, dmin: np.ndarray, packed: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """q5_K super-blocks' bytes from their f16 d and dmin, 12 packed scale bytes and 5-bit codes [n, 8, 32]."""
    high = (codes >> 4) & 1  # [n, 8, 32]: bit b of qh[j] is block b's fifth bit of weight j
    qh = np.zeros((len(codes), 32), np.uint8)
    for b in range(8):
        qh |= high[:, b] << b
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, qh, _low_nibbles(codes)],
                          axis=1)


def _q6_k_blocks(x: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """q6_K super-blocks of x [n, 256]; `weights` [n, 256]: an importance matrix's, as ggml's quantize_q6_K takes
    them (None: the reference quantizer's x^2)."""
    columns = lambda a: np.ascontiguousarray(a.reshape(-1, 16).T)  # noqa: E731
    scales, codes = _symmetric_scale(columns(x), 32, None if weights is None else columns(weights))
    scales, codes = scales.reshape(-1, 16), codes.T.reshape(-1, 16, 16)
    first = np.argmax(np.abs(scales), axis=-1)
    max_scale = np.take_along_axis(scales, first[:, None], axis=-1)[:, 0]
    zero = np.abs(max_scale) < _EPS
    with np.errstate(divide="ignore"):
        iscale = f32(-128) / np.where(zero, f32(1), max_scale)
        d = _f16(f32(1) / iscale)
    sc = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
    step = d.astype(f32)[:, None] * sc.astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest(x.reshape(-1, 16, 16) / step[..., None]), -32, 31) + 32
    codes = np.where((step != 0)[..., None], requant, codes).astype(np.uint8).reshape(-1, 2, 4, 32)
    low, high = codes & 0xF, codes >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)],
                         axis=1)
    out[zero] = 0
    return out


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """The q4_K bytes [..., K / 256 * 144] of a float tensor [..., K] (K a multiple of 256), as GGUF stores them."""
    return _in_chunks(w, "q4_K", _q4_k_blocks, Q4_K_BYTES)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """The q5_K bytes [..., K / 256 * 176] of a float tensor [..., K] (K a multiple of 256), as GGUF stores them."""
    return _in_chunks(w, "q5_K", _q5_k_blocks, Q5_K_BYTES)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """The q6_K bytes [..., K / 256 * 210] of a float tensor [..., K] (K a multiple of 256), as GGUF stores them."""
    return _in_chunks(w, "q6_K", _q6_k_blocks, Q6_K_BYTES)


def dequantize_q4_k(data: np.ndarray) -> np.ndarray:
    """The float32 weights [..., K] of q4_K bytes [..., K / 256 * 144]."""
    b = np.ascontiguousarray(data, np.uint8).reshape(-1, Q4_K_BYTES)
    d = b[:, 0:2].copy().view(np.float16)[:, 0].astype(f32)
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0].astype(f32)
    sc, m = _unpacked_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32).astype(f32)
    w = (d[:, None] * sc)[..., None] * q - (dmin[:, None] * m)[..., None]
    return w.reshape(*data.shape[:-1], data.shape[-1] // Q4_K_BYTES * QK_K)


def dequantize_q5_k(data: np.ndarray) -> np.ndarray:
    """The float32 weights [..., K] of q5_K bytes [..., K / 256 * 176]."""
    b = np.ascontiguousarray(data, np.uint8).reshape(-1, Q5_K_BYTES)
    d = b[:, 0:2].copy().view(np.float16)[:, 0].astype(f32)
    dmin = b[:, 2:4].copy().view(np.float16)[:, 0].astype(f32)
    sc, m = _unpacked_scales(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:].reshape(-1, 4, 32)
    low = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32)
    high = np.stack([(qh >> k) & 1 for k in range(8)], axis=1)  # [n, 8, 32]
    q = (low | (high << 4)).astype(f32)
    w = (d[:, None] * sc)[..., None] * q - (dmin[:, None] * m)[..., None]
    return w.reshape(*data.shape[:-1], data.shape[-1] // Q5_K_BYTES * QK_K)


def _unpacked_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums [n, 8] of q4_K's / q5_K's 12 packed bytes [n, 12], as float32."""
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1).astype(f32)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1).astype(f32)
    return sc, m


def dequantize_q6_k(data: np.ndarray) -> np.ndarray:
    """The float32 weights [..., K] of q6_K bytes [..., K / 256 * 210]."""
    b = np.ascontiguousarray(data, np.uint8).reshape(-1, Q6_K_BYTES)
    ql, qh = b[:, :128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 32)
    sc = b[:, 192:208].copy().view(np.int8).astype(f32)
    d = b[:, 208:210].copy().view(np.float16)[:, 0].astype(f32)
    low = np.stack([ql[:, :, 0] & 0xF, ql[:, :, 1] & 0xF, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=2)
    q = ((low | (high << 4)).astype(f32) - 32).reshape(-1, 16, 16)
    w = (d[:, None] * sc)[..., None] * q
    return w.reshape(*data.shape[:-1], data.shape[-1] // Q6_K_BYTES * QK_K)
