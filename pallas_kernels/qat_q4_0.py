"""Quantization-aware training's q4_0 weight in one pass, for GPU in Pallas (Triton): q4_0's read-back of
(NF4 W + scale * B @ A), written in bf16 straight from bitsandbytes' codes, and its pure-jnp reference.

What QAT's forward multiplies by is the merged weight rounded as llama.cpp's q4_0 stores it: per 32 consecutive
weights of a row, d = (the weight of largest magnitude, the first on ties) / -8 stored in float16, codes
q = trunc(w / d + 8.5) clipped to 15, read back as d * (q - 8). In XLA that is several passes over float32 copies
of every weight, twice per step (forward and the rematerialized backward); here one program reads a tile of codes,
dequantizes it (the NF4 table times the block's float32 absmax), adds the LoRA product of its rows and columns
(an f32 dot of B's rows and A's columns), rounds each 32-weight block in registers and stores bf16: the bytes the
plain step's dequantization moves. A 16-byte run of codes is one q4_0 block: its high nibbles are the block's even
weights, its low nibbles the odd ones, so a block's scale is a reduction over the two planes of one load.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.nf4_dequant import nf4_dequantize_reference
from pallas_kernels.nf4_tiles import (
    BLOCK, BYTES_PER_BLOCK, MatmulTiles, at_layer, block_scales, check_weight, fit_tiles, layer_codes,
    layer_operand, lut_operand, nf4_lookup, optional_refs, scales_operand, tile_spec,
)

Q4_0_BLOCK = 32  # weights per q4_0 block: 16 bytes of NF4 codes
_CHUNK = Q4_0_BLOCK // 2
_LORA_RANK_STEP = 16  # a tensor-core dot's smallest contraction: the rank is padded with zero rows to a multiple


def round_trip_q4_0_reference(w: jax.Array) -> jax.Array:
    """W [..., K] (float32) as a q4_0 file reads it back: d * (q - 8), d = the block's first largest-magnitude
    weight / -8 in float16."""
    blocks = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // Q4_0_BLOCK, Q4_0_BLOCK)
    d = jnp.take_along_axis(blocks, jnp.argmax(jnp.abs(blocks), axis=-1, keepdims=True), axis=-1) / -8
    inverse = jnp.where(d == 0, 0.0, 1 / jnp.where(d == 0, 1.0, d))
    q = jnp.minimum(jnp.trunc(jax.lax.optimization_barrier(blocks * inverse) + 8.5), 15)
    return (d.astype(jnp.float16).astype(jnp.float32) * (q - 8)).reshape(w.shape)


def qat_q4_0_reference(codes: jax.Array, absmax: jax.Array, a: jax.Array, b: jax.Array, scale: float,
                       dtype=jnp.bfloat16) -> jax.Array:
    """round_trip_q4_0(NF4[codes] * absmax + scale * B @ A) [N, K] in dtype; A [r, K], B [N, r] float32."""
    w = nf4_dequantize_reference(codes, absmax, jnp.float32)
    w = w + scale * jnp.dot(b.astype(jnp.float32), a.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return round_trip_q4_0_reference(w).astype(dtype)


def _product_unfused(x: jax.Array, y: jax.Array, interpret: bool) -> jax.Array:
    """x * y rounded before any add (PTX `mul.rn` is never contracted into a fused multiply-add), as ggml's
    reference rounds w / d before adding 8.5."""
    if interpret:
        return x * y
    [out] = pltriton.elementwise_inline_asm("mul.rn.f32 $0, $1, $2;", args=[x, y], constraints="=f,f,f", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out


def _round_block(w_even: jax.Array, w_odd: jax.Array, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """One q4_0 block per row, given as its even and odd weights [rows, 16] (float32): both read back."""
    size = w_even.shape[1]
    a_even, a_odd = jnp.abs(w_even), jnp.abs(w_odd)
    largest = jnp.maximum(jnp.max(a_even, axis=1), jnp.max(a_odd, axis=1))[:, None]
    position = 2 * jax.lax.broadcasted_iota(jnp.int32, w_even.shape, 1)  # the weight's index in the block
    first = jnp.minimum(jnp.min(jnp.where(a_even == largest, position, 2 * size), axis=1),
                        jnp.min(jnp.where(a_odd == largest, position + 1, 2 * size), axis=1))[:, None]
    signed = (jnp.sum(jnp.where(position == first, w_even, 0.0), axis=1)
              + jnp.sum(jnp.where(position + 1 == first, w_odd, 0.0), axis=1))[:, None]
    d = signed / -8
    inverse = jnp.where(d == 0, 0.0, 1 / jnp.where(d == 0, 1.0, d))
    stored = d.astype(jnp.float16).astype(jnp.float32)

    def read_back(w):  # w / d + 8.5 >= 0.5 - rounding, so floor is ggml's truncation
        q = jnp.minimum(jnp.floor(_product_unfused(w, jnp.broadcast_to(inverse, w.shape), interpret) + 8.5), 15.0)
        return stored * (q - 8.0)

    return read_back(w_even), read_back(w_odd)


def _qat_kernel(codes_ref, absmax_ref, a_even_ref, a_odd_ref, b_ref, *refs, block_bytes, scale, stacked,
                interpret):
    """The read-back tile [bn, 2 * block_bytes] in memory order, one 16-byte q4_0 block of codes at a time."""
    layer_ref, _, _, lut_ref, w_ref = optional_refs(refs, stacked, 1)
    j = pl.program_id(1)
    b = b_ref[...].astype(jnp.float32)
    for c in range(block_bytes // _CHUNK):
        cols = pl.ds(c * _CHUNK, _CHUNK)
        codes = at_layer(codes_ref, layer_ref, (slice(None), cols))
        [nf4_scale] = block_scales(absmax_ref, layer_ref, j * block_bytes + c * _CHUNK, slice(None),
                                   BYTES_PER_BLOCK)  # the 64-value NF4 block holding these 32 weights
        nf4_scale = nf4_scale[:, None]
        # float32 products as IEEE float32 (Triton's default for float32 is TF32: codes one apart in 0.3% of weights)
        lora_even = jnp.dot(b, a_even_ref[:, cols].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        lora_odd = jnp.dot(b, a_odd_ref[:, cols].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        w_even = nf4_lookup(codes >> 4, lut_ref) * nf4_scale + scale * lora_even
        w_odd = nf4_lookup(codes & 15, lut_ref) * nf4_scale + scale * lora_odd
        even, odd = _round_block(w_even, w_odd, interpret)
        w_ref[:, pl.ds(c * 2 * _CHUNK, 2 * _CHUNK)] = jnp.stack([even, odd], axis=-1).reshape(
            even.shape[0], 2 * _CHUNK).astype(w_ref.dtype)


def qat_q4_0_weight(a: jax.Array, b: jax.Array, codes: jax.Array, absmax: jax.Array, *, scale: float,
                    dtype=jnp.bfloat16, layer: jax.Array | None = None, block_n: int = 64, block_bytes: int = 64,
                    num_warps: int = 4, lut: str = "gather", interpret: bool = False) -> jax.Array:
    """round_trip_q4_0(NF4 W + scale * B @ A) [N, K] in dtype, one pass over the codes. A [r, K], B [N, r]; codes
    uint8 [N, K/2] (or a stack [layers, N, K/2] read in place at `layer`); absmax the float32 block scales [N, K/64]
    (or prepared [layers, K/64, N], `pallas_kernels.nf4_tiles.scales_operand`)."""
    n, k = check_weight(codes, absmax, layer=layer)
    codes, _ = layer_codes(codes, layer)
    half = k // 2
    if a.shape[-1] != k or b.shape[0] != n or a.shape[0] != b.shape[1]:
        raise ValueError(f"LoRA factors A {a.shape}, B {b.shape} do not fit a weight [{n}, {k}]")
    tiles = fit_tiles(MatmulTiles(block_n=block_n, block_bytes=block_bytes), n, half, "k")
    bn, bb = tiles.block_n, tiles.block_bytes
    rank = a.shape[0]
    padded = -(-rank // _LORA_RANK_STEP) * _LORA_RANK_STEP
    a = jnp.pad(a.astype(jnp.float32), ((0, padded - rank), (0, 0)))
    b = jnp.pad(b.astype(jnp.float32), ((0, 0), (0, padded - rank)))
    a_even, a_odd = a[:, 0::2], a[:, 1::2]  # the planes' columns: high nibbles hold W's even columns
    lut_specs, lut_args = lut_operand(lut)
    layer_specs, layer_args = layer_operand(layer)
    scales = scales_operand(absmax)
    return pl.pallas_call(
        functools.partial(_qat_kernel, block_bytes=bb, scale=float(scale), stacked=layer is not None,
                          interpret=interpret),
        grid=(n // bn, half // bb),
        in_specs=[
            tile_spec(codes, (bn, bb), lambda i, j: (i, j)),
            tile_spec(scales, (k // BLOCK, bn), lambda i, j: (0, i)),
            pl.BlockSpec((padded, bb), lambda i, j: (0, j)),
            pl.BlockSpec((padded, bb), lambda i, j: (0, j)),
            pl.BlockSpec((bn, padded), lambda i, j: (i, 0)),
            *layer_specs,
            *lut_specs,
        ],
        out_specs=pl.BlockSpec((bn, 2 * bb), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n, k), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="qat_q4_0_weight",
    )(codes, scales, a_even, a_odd, b, *layer_args, *lut_args)
