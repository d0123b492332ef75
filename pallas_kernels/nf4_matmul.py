"""Fused NF4 dequant-matmul for GPU in Pallas (Triton): y = x @ dequant(W)ᵀ and dx = dy @ dequant(W).

The weight stays in bitsandbytes' byte layout: codes uint8 [N, K/2], byte i of row n holding W[n, 2i]
in the high nibble and W[n, 2i+1] in the low one. Rather than interleaving nibbles on chip, the kernels
split the contraction: x @ Wᵀ = x[:, 0::2] @ W_hiᵀ + x[:, 1::2] @ W_loᵀ. The wrapper hands the forward
kernel x with its even columns first, then its odd ones (one cheap pass over x; strided loads inside
the kernel measured 2x slower), and each nibble plane feeds a tensor-core dot directly. A 32-byte tile
covers exactly one 64-value absmax block, so one scale per row serves both planes. Dequantization
(NF4 value by a select tree on the 4 bits, times the float32 absmax, rounded to the compute dtype:
bitsandbytes' arithmetic, bit for bit) happens in registers per tile; no bf16 copy of W reaches HBM.
Small M splits the reduction across programs to fill the GPU.

`absmax` here is the per-block float32 scale [N, K/64] (double quantization already undone: a vector
1/16 the size of W's codes); with a layer index it may also be a stack prepared in the kernels' own layout
[layers, K/64, N] (`ops.prepare_kernel_scales`: done once for every layer outside the layer scan).
The dequant-only kernels (W in bf16 or e4m3 for "dequantize, then cuBLAS") are in `nf4_dequant.py`, the decoding
both share in `nf4_tiles.py`. Also here: the pure-jnp reference and the custom VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nf4_dequant import bf16_planes, nf4_dequantize_reference
from pallas_kernels.nf4_tiles import (
    BLOCK, MatmulTiles, at_layer, block_scales, check_weight, fit_tiles, layer_codes, layer_operand, lut_operand,
    nibble_planes, optional_refs, scales_operand, tile_scale, tile_spec,
)


def nf4_matmul_reference(x: jax.Array, codes: jax.Array, absmax: jax.Array) -> jax.Array:
    """x [..., K] @ dequant(W)ᵀ with f32 accumulation, x's dtype out."""
    w = nf4_dequantize_reference(codes, absmax, x.dtype)
    return jnp.einsum("...k,nk->...n", x, w, preferred_element_type=jnp.float32).astype(x.dtype)


# ---------------------------------------------------------------------------------------------------- kernels


def _matmul_kernel(x_ref, codes_ref, absmax_ref, *refs, half, block_bytes, steps, stacked, gemv, weight_first,
                   permute, interpret):
    """y tile [bm, bn] (+= over this program's share of K) = x_even @ W_hiᵀ + x_odd @ W_loᵀ (`gemv`: products
    accumulated elementwise in float32 over the steps, no tensor-core dot, and summed over the tile's bytes once
    at the end: a sum per step costs a cross-thread reduction per step; `weight_first`: accumulated transposed,
    W_hi @ x_evenᵀ + W_lo @ x_oddᵀ, and transposed once at the store; `permute`: the planes decoded by byte
    permutes from a bf16 table per (row, block))."""
    layer_ref, _, _, lut_ref, y_ref = optional_refs(refs, stacked, 1)
    s = pl.program_id(2)
    bm, bn = y_ref.shape
    rows = slice(None)

    def body(t, acc):
        byte0 = (s * steps + t) * block_bytes
        codes = at_layer(codes_ref, layer_ref, (slice(None), pl.ds(byte0, block_bytes)))
        if permute:
            w_hi, w_lo = bf16_planes(codes, block_scales(absmax_ref, layer_ref, byte0, rows, block_bytes), interpret)
        else:
            scale = tile_scale(absmax_ref, layer_ref, byte0, rows, block_bytes)
            w_hi, w_lo = nibble_planes(codes, scale, jnp.float32 if gemv else x_ref.dtype, lut_ref)
        x_even = x_ref[:, pl.ds(byte0, block_bytes)]
        x_odd = x_ref[:, pl.ds(half + byte0, block_bytes)]
        if gemv:  # [bm, bn, block_bytes] products
            x_even, x_odd = x_even.astype(jnp.float32)[:, None, :], x_odd.astype(jnp.float32)[:, None, :]
            return acc + x_even * w_hi[None] + x_odd * w_lo[None]
        if weight_first:  # [bn, bm]
            acc = acc + pltriton.dot(w_hi, x_even, trans_b=True)
            return acc + pltriton.dot(w_lo, x_odd, trans_b=True)
        acc = acc + pltriton.dot(x_even, w_hi, trans_b=True)
        return acc + pltriton.dot(x_odd, w_lo, trans_b=True)

    shape = (bm, bn, block_bytes) if gemv else (bn, bm) if weight_first else (bm, bn)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
    y_ref[...] = (jnp.sum(acc, axis=2) if gemv else acc.T if weight_first else acc).astype(y_ref.dtype)


def _matmul_t_kernel(dy_ref, codes_ref, absmax_ref, *refs, block_n, block_bytes, steps, stacked):
    """dx tiles [bm, block_bytes] of the even and odd columns: dy @ W_hi and dy @ W_lo over N."""
    layer_ref, _, _, lut_ref, dx_even_ref, dx_odd_ref = optional_refs(refs, stacked, 2)
    j = pl.program_id(1)
    s = pl.program_id(2)
    bm = dy_ref.shape[0]
    byte0 = j * block_bytes

    def body(t, carry):
        acc_even, acc_odd = carry
        n0 = (s * steps + t) * block_n
        rows = pl.ds(n0, block_n)
        codes = at_layer(codes_ref, layer_ref, (rows, slice(None)))
        scale = tile_scale(absmax_ref, layer_ref, byte0, rows, block_bytes)
        w_hi, w_lo = nibble_planes(codes, scale, dy_ref.dtype, lut_ref)
        dy = dy_ref[:, rows]
        return acc_even + pltriton.dot(dy, w_hi), acc_odd + pltriton.dot(dy, w_lo)

    zeros = jnp.zeros((bm, block_bytes), jnp.float32)
    acc_even, acc_odd = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
    dx_even_ref[...] = acc_even.astype(dx_even_ref.dtype)
    dx_odd_ref[...] = acc_odd.astype(dx_odd_ref.dtype)


# --------------------------------------------------------------------------------------------------- wrappers


def _split_even_odd(x: jax.Array) -> jax.Array:
    """x with its even columns first, then its odd ones: contiguous operands for the two nibble planes
    (strided loads inside the kernel measured 2x slower: they defeat Triton's async copies)."""
    return jnp.concatenate([x[:, 0::2], x[:, 1::2]], axis=1)


def _pad_rows(x: jax.Array, block: int) -> jax.Array:
    m = x.shape[0]
    mp = pl.cdiv(m, block) * block
    return x if mp == m else jnp.pad(x, ((0, mp - m), (0, 0)))


def split_sum(parts: jax.Array) -> jax.Array:
    """The K-split partial products [split, ...] summed in one fixed order: a reduce leaves its order to the
    compiler, which may pick another in another fusion, and one float32 rounding apart becomes a bf16 step apart."""
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def nf4_matmul_forward(x: jax.Array, codes: jax.Array, absmax: jax.Array, *, tiles: MatmulTiles = MatmulTiles(),
                       layer: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """y [..., N] = x [..., K] @ dequant(W)ᵀ, fused (no gradient rule: see `nf4_matmul`). With `layer`, codes
    is a stack [layers, N, K/2] read at that layer in place."""
    lead, k = x.shape[:-1], x.shape[-1]
    n, _ = check_weight(codes, absmax, k, layer)
    if tiles.lut == "permute" and (x.dtype != jnp.bfloat16 or tiles.gemv):
        raise ValueError(f"lut='permute' decodes W to bf16 for tensor-core tiles: x must be bfloat16 and gemv off, "
                         f"got x {x.dtype}, gemv={tiles.gemv}")
    codes, _ = layer_codes(codes, layer)
    half = k // 2
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    tiles = fit_tiles(tiles, n, half, "k")
    bm, bn, bb, split = tiles.block_m, tiles.block_n, tiles.block_bytes, tiles.split
    if tiles.gemv:  # no tensor-core tile to fill: as few rows as there are
        bm = min(bm, pl.next_power_of_2(m))
    steps = half // bb // split
    xp = _pad_rows(_split_even_odd(x2), bm)
    mp = xp.shape[0]
    out_dtype = x.dtype if split == 1 else jnp.float32
    lut_specs, lut_args = lut_operand(tiles.lut)
    layer_specs, layer_args = layer_operand(layer)
    scales = scales_operand(absmax)
    y = pl.pallas_call(
        functools.partial(_matmul_kernel, half=half, block_bytes=bb, steps=steps, stacked=layer is not None,
                          gemv=tiles.gemv, weight_first=tiles.weight_first, permute=tiles.lut == "permute",
                          interpret=interpret),
        grid=(mp // bm, n // bn, split),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j, s: (i, 0)),
            tile_spec(codes, (bn, half), lambda i, j, s: (j, 0)),
            tile_spec(scales, (k // BLOCK, bn), lambda i, j, s: (0, j)),
            *layer_specs,
            *lut_specs,
        ],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split, mp, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="nf4_matmul",
    )(xp, codes, scales, *layer_args, *lut_args)
    y = y[0] if split == 1 else split_sum(y).astype(x.dtype)
    return y[:m].reshape(*lead, n)


def nf4_matmul_dx(dy: jax.Array, codes: jax.Array, absmax: jax.Array, *, tiles: MatmulTiles = MatmulTiles(),
                  layer: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """dx [..., K] = dy [..., N] @ dequant(W), fused (with `layer`: codes stacked, read at that layer)."""
    n, k = check_weight(codes, absmax, layer=layer)
    codes, _ = layer_codes(codes, layer)
    if dy.shape[-1] != n:
        raise ValueError(f"dy has N={dy.shape[-1]} but the NF4 weight has N={n}")
    if tiles.gemv or tiles.weight_first or tiles.lut == "permute":
        raise ValueError("gemv, weight_first and permute tiles are for the forward kernel; dx takes tensor-core "
                         "tiles with x's rows first and the 'gather' or 'select' lookup")
    lead = dy.shape[:-1]
    half = k // 2
    dy2 = dy.reshape(-1, n)
    m = dy2.shape[0]
    tiles = fit_tiles(tiles, n, half, "n")
    bm, bn, bb, split = tiles.block_m, tiles.block_n, tiles.block_bytes, tiles.split
    steps = n // bn // split
    dyp = _pad_rows(dy2, bm)
    mp = dyp.shape[0]
    out_dtype = dy.dtype if split == 1 else jnp.float32
    lut_specs, lut_args = lut_operand(tiles.lut)
    layer_specs, layer_args = layer_operand(layer)
    scales = scales_operand(absmax)
    dx_even, dx_odd = pl.pallas_call(
        functools.partial(_matmul_t_kernel, block_n=bn, block_bytes=bb, steps=steps, stacked=layer is not None),
        grid=(mp // bm, half // bb, split),
        in_specs=[
            pl.BlockSpec((bm, n), lambda i, j, s: (i, 0)),
            tile_spec(codes, (n, bb), lambda i, j, s: (0, j)),
            tile_spec(scales, (k // BLOCK, n), lambda i, j, s: (0, 0)),
            *layer_specs,
            *lut_specs,
        ],
        out_specs=[pl.BlockSpec((None, bm, bb), lambda i, j, s: (s, i, j))] * 2,
        out_shape=[jax.ShapeDtypeStruct((split, mp, half), out_dtype)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="nf4_matmul_dx",
    )(dyp, codes, scales, *layer_args, *lut_args)
    if split > 1:
        dx_even, dx_odd = split_sum(dx_even), split_sum(dx_odd)
    else:
        dx_even, dx_odd = dx_even[0], dx_odd[0]
    dx = jnp.stack([dx_even[:m], dx_odd[:m]], axis=-1).reshape(m, k).astype(dy.dtype)
    return dx.reshape(*lead, k)


# ------------------------------------------------------------------------------------------------- custom VJP


def _zero_like(a):
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, dtype=jax.dtypes.float0)
    return jnp.zeros_like(a)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _nf4_matmul(x, codes, absmax, tiles, dx_tiles, interpret):
    return nf4_matmul_forward(x, codes, absmax, tiles=tiles, interpret=interpret)


def _nf4_matmul_fwd(x, codes, absmax, tiles, dx_tiles, interpret):
    return _nf4_matmul(x, codes, absmax, tiles, dx_tiles, interpret), (codes, absmax)


def _nf4_matmul_bwd(tiles, dx_tiles, interpret, res, dy):
    codes, absmax = res
    dx = nf4_matmul_dx(dy, codes, absmax, tiles=dx_tiles, interpret=interpret)
    return dx, _zero_like(codes), _zero_like(absmax)


_nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


def nf4_matmul(x: jax.Array, codes: jax.Array, absmax: jax.Array, *, tiles: MatmulTiles = MatmulTiles(),
               dx_tiles: MatmulTiles = MatmulTiles(block_m=64, block_n=64, block_bytes=32),
               interpret: bool = False) -> jax.Array:
    """x @ dequant(W)ᵀ with a fused backward dx = dy @ dequant(W); W is frozen (zero cotangents)."""
    return _nf4_matmul(x, codes, absmax, tiles, dx_tiles, interpret)
