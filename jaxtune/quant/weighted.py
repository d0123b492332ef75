"""llama.cpp's quantizers with an importance matrix, in numpy: q4_0, q4_1, q5_0, q5_1, q4_K, q5_K and q6_K bytes
as `llama-quantize --imatrix` writes them.

An importance vector holds one weight per input column (the mean square of that column's input over a calibration
text); each block's scale (and minimum) is then the one with the least error weighted by it, so the columns the
model's inputs use most lose least. These are ggml's `quantize_row_*_impl` with `quant_weights` (make_qx_quants,
make_qkx3_quants and make_qp_quants), vectorized over blocks with float32 sums in ggml's order, so the bytes are
ggml's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxtune.quant.k_quants import (QK_K, _EPS, _f16, _nearest, _ordered_sum, _packed_scales, _q6_k_blocks,
                                    _scale_and_min, _symmetric_scale, q4_k_bytes, q5_k_bytes)

f32 = np.float32
WEIGHTED_FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K")
_ROWS_PER_TASK = 64


def _columns(a: np.ndarray, n: int) -> np.ndarray:
    """[..., k * n] -> [n, blocks]: each block of n a column, so that every sum runs over contiguous rows."""
    return np.ascontiguousarray(a.reshape(-1, n).T)


def _row_sigma2(x: np.ndarray) -> np.ndarray:
    """Per row of x [rows, n]: the mean of its squares, summed in order (ggml's sigma2 of the 32-weight formats)."""
    return _ordered_sum(np.ascontiguousarray((x * x).T)) / f32(x.shape[1])


def _legacy_weights(x: np.ndarray, imatrix: np.ndarray) -> np.ndarray:
    """qw * sqrt(sigma2 + x^2) [rows, n]: the error weights of q4_0 / q4_1 / q5_0 / q5_1."""
    return imatrix[None, :] * np.sqrt(_row_sigma2(x)[:, None] + x * x)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[blocks, 32] codes -> the 16 bytes of their low 4 bits (weight j low nibble, weight j + 16 high)."""
    return ((codes[:, :16] & 0xF) | ((codes[:, 16:] & 0xF) << 4)).astype(np.uint8)


def _fifth_bits(codes: np.ndarray) -> np.ndarray:
    """[blocks, 32] codes -> the uint32 (little-endian bytes) whose bit j is code j's fifth bit."""
    bits = ((codes >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4")[:, None].view(np.uint8)


def _symmetric_blocks(x: np.ndarray, imatrix: np.ndarray, nmax: int):
    """q4_0 / q5_0: each 32-weight block's scale by make_qx_quants (rmse_type 1, the error weights): (d f16 [b],
    codes 0..2 nmax - 1 [b, 32])."""
    weights = _legacy_weights(x, imatrix)
    scale, codes = _symmetric_scale(_columns(x, 32), nmax, _columns(weights, 32))
    return _f16(scale), codes.T


def _scale_min_blocks(x: np.ndarray, imatrix: np.ndarray, nmax: int):
    """q4_1 / q5_1: each 32-weight block's scale and minimum by make_qkx3_quants: (d, m f16 [b], codes [b, 32])."""
    weights = _legacy_weights(x, imatrix)
    scale, the_min, codes = _scale_and_min(_columns(x, 32), _columns(weights, 32), nmax, -0.9, 0.05, 36)
    return _f16(scale), _f16(-the_min), codes.T


def _q4_0(x, imatrix):
    d, codes = _symmetric_blocks(x, imatrix, 8)
    return np.concatenate([d[:, None].view(np.uint8), _nibbles(codes)], axis=1)


def _q5_0(x, imatrix):
    d, codes = _symmetric_blocks(x, imatrix, 16)
    return np.concatenate([d[:, None].view(np.uint8), _fifth_bits(codes), _nibbles(codes)], axis=1)


def _q4_1(x, imatrix):
    d, m, codes = _scale_min_blocks(x, imatrix, 15)
    return np.concatenate([d[:, None].view(np.uint8), m[:, None].view(np.uint8), _nibbles(codes)], axis=1)


def _q5_1(x, imatrix):
    d, m, codes = _scale_min_blocks(x, imatrix, 31)
    return np.concatenate([d[:, None].view(np.uint8), m[:, None].view(np.uint8), _fifth_bits(codes),
                           _nibbles(codes)], axis=1)


def _scale_quants(x: np.ndarray, weights: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's make_qp_quants over the rows of x [b, n] (values >= 0, the blocks' scales or minimums) with weights
    [b, n]: (the super-block scale [b], codes 0..nmax [b, n] as ggml's uint8 stores them)."""
    peak = np.maximum(x.max(1), f32(0))
    zero = peak < _EPS
    peak = np.where(zero, f32(1), peak)
    cols, w = np.ascontiguousarray(x.T), np.ascontiguousarray(weights.T)  # [n, b]
    iscale = f32(nmax) / peak
    levels = _nearest(iscale * cols) & 0xFF
    diff = cols - (f32(1) / iscale) * levels.astype(f32)
    best = _ordered_sum(w * diff * diff)
    for step in (-4, -3, -2, -1, 1, 2, 3, 4):
        trial = (f32(0.1) * f32(step) + f32(nmax)) / peak
        lf = np.minimum(nmax, _nearest(trial * cols)).astype(f32)
        diff = cols - (f32(1) / trial) * lf
        mse = _ordered_sum(w * diff * diff)
        iscale = np.where(mse < best, trial, iscale)
        best = np.minimum(mse, best)
    levels = np.minimum(nmax, _nearest(iscale * cols)) & 0xFF
    lf = levels.astype(f32)
    sumlx, suml2 = _ordered_sum(w * cols * lf), _ordered_sum(w * lf * lf)
    for _ in range(5):  # one weight at a time, each moved to its best level given the others (a pass that moves
        for i in range(cols.shape[0]):  # none leaves the next pass nothing to move either)
            li = levels[i].astype(f32)
            slx = sumlx - w[i] * cols[i] * li
            sl2 = suml2 - w[i] * li * li
            ok = (slx > 0) & (sl2 > 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                new = np.minimum(nmax, _nearest(np.where(ok, cols[i] * sl2 / np.where(ok, slx, f32(1)), f32(0))))
            nf = new.astype(f32)
            slx = slx + w[i] * cols[i] * nf
            sl2 = sl2 + w[i] * nf * nf
            take = ok & (new != levels[i]) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            levels[i] = np.where(take, new & 0xFF, levels[i])
            sumlx, suml2 = np.where(take, slx, sumlx), np.where(take, sl2, suml2)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 > 0, sumlx / suml2, f32(0))
    return np.where(zero, f32(0), scale), np.where(zero[None], 0, levels).T.astype(np.uint8)


def _k_blocks(x: np.ndarray, imatrix: np.ndarray, nmax: int):
    """q4_K / q5_K super-blocks x [b, 256] with their importance [b, 256]: weights qw * sqrt(sigma2 + x^2), each
    32-block's scale and minimum by make_qkx3_quants, those quantized to 6 bits by make_qp_quants weighted by each
    block's weight sum."""
    sigma2 = f32(2) * _ordered_sum(np.ascontiguousarray((x * x).T)) / f32(QK_K)
    weights = imatrix * np.sqrt(sigma2[:, None] + x * x)
    block_weights = _ordered_sum(_columns(weights, 32)).reshape(-1, 8)  # [b, 8]
    scales, mins, codes = _scale_and_min(_columns(x, 32), _columns(weights, 32), nmax, -0.9, 0.05, 36)
    scales, mins, codes = scales.reshape(-1, 8), mins.reshape(-1, 8), codes.T.reshape(-1, 8, 32)
    d, ls = _scale_quants(scales, block_weights, 63)
    dmin, lm = _scale_quants(mins, block_weights, 63)
    if nmax == 31:  # q5_K keeps them within 6 bits
        ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    return _packed_scales(x.reshape(-1, 8, 32), ls, lm, _f16(d), _f16(dmin), codes, nmax)


def _q4_k(x, imatrix):
    return q4_k_bytes(*_k_blocks(x, imatrix, 15))


def _q5_k(x, imatrix):
    return q5_k_bytes(*_k_blocks(x, imatrix, 31))


def _q6_k(x, imatrix):
    return _q6_k_blocks(x, np.ascontiguousarray(imatrix, f32))


# format -> (its blocks' function, weights per block, whether that function takes whole rows (the 32-weight formats,
# whose sigma2 is the row's) or 256-weight super-blocks with their importance)
_FORMATS = {"q4_0": (_q4_0, 32, True), "q4_1": (_q4_1, 32, True), "q5_0": (_q5_0, 32, True),
            "q5_1": (_q5_1, 32, True), "q4_K": (_q4_k, QK_K, False), "q5_K": (_q5_k, QK_K, False),
            "q6_K": (_q6_k, QK_K, False)}


def quantize_weighted(w: np.ndarray, imatrix: np.ndarray, fmt: str) -> np.ndarray:
    """The `fmt` bytes [..., K / block * bytes] of a float tensor [..., K] quantized with `imatrix` [K] (one weight
    per input column, >= 0), as ggml's quantize_<fmt> with quant_weights writes them."""
    if fmt not in _FORMATS:
        raise ValueError(f"no importance-weighted quantizer for {fmt!r}; one of {', '.join(WEIGHTED_FORMATS)}")
    fn, block, by_row = _FORMATS[fmt]
    k = w.shape[-1]
    imatrix = np.ascontiguousarray(imatrix, f32)
    if k % block or imatrix.shape != (k,):
        raise ValueError(f"{fmt} with an importance matrix needs rows of whole {block}-weight blocks and one weight "
                         f"per column; got rows of {k} and {imatrix.shape} weights")
    rows = np.ascontiguousarray(w, f32).reshape(-1, k)

    def task(start: int) -> np.ndarray:
        x = rows[start:start + _ROWS_PER_TASK]
        if by_row:
            return fn(x, imatrix).reshape(len(x), -1)
        supers = x.reshape(-1, QK_K)
        importance = np.broadcast_to(imatrix.reshape(1, -1, QK_K), (len(x), k // QK_K, QK_K)).reshape(-1, QK_K)
        return fn(supers, np.ascontiguousarray(importance)).reshape(len(x), -1)

    starts = range(0, len(rows), _ROWS_PER_TASK)
    with ThreadPoolExecutor(max_workers=max(1, min(len(starts), os.cpu_count() or 1))) as pool:
        parts = list(pool.map(task, starts))
    out = np.concatenate(parts) if parts else np.zeros((0, 0), np.uint8)
    return out.reshape(*w.shape[:-1], -1)
