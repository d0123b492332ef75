"""Grouped FP8 GEMM for mixture-of-experts layers in Pallas (Triton): each tile of rows times its own expert's
e4m3 weight, on the FP8 tensor cores (Ada, Hopper).

The layout is that of `grouped_matmul.py` (rows grouped by expert in whole tiles of `block_m`, `tile_group[i]`
tile i's expert, -1 for an unused tile written as zeros). Both operands are K-major e4m3 with power-of-two scales
outside the contraction: one per row of x (`x_scale` [M]) and one per output column of each expert's weight
(`w_scale` [E, N]). The tile's product accumulates in float32 over K and is scaled once in the epilogue; as the
scales are powers of two the result equals float32 arithmetic on the dequantized operands up to the order of the
sums (`grouped_fp8_matmul_reference`).

The same kernel serves the frozen experts' forward (x = the routed rows, W [E, out, in]) and their input gradient
(x = the output gradient's rows, Wᵀ [E, in, out] with a scale per input column); `grouped_fp8_matmul` pairs them in a
custom VJP (the weights are frozen: zero cotangents).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.grouped_matmul import zero_unused_tile
from pallas_kernels.fp8_quantize import FP8_FORMATS, quantize_blocks, quantize_rows, quantize_rows_reference


@dataclass(frozen=True)
class GroupedFp8Tiles:
    """Rows per tile (the layout's padding unit), output columns and K step per program, launch parameters."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 4


def fp8_expert_weights(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(wq [E, N, K], w_scale [E, N], wtq [E, K, N], wt_scale [E, K]): the experts' weights W [E, N, K] and their
    transposes in e4m3, each row with the power of two that brings its largest |value| to e4m3's range (the
    forward's and the input gradient's operands of `grouped_fp8_matmul`)."""
    wq, w_scale = quantize_blocks(w, None, "e4m3")
    wtq, wt_scale = quantize_blocks(jnp.swapaxes(w, 1, 2), None, "e4m3")
    return wq, w_scale[..., 0], wtq, wt_scale[..., 0]


def grouped_fp8_matmul_reference(xq: jax.Array, x_scale: jax.Array, wq: jax.Array, w_scale: jax.Array,
                                 tile_group: jax.Array, block_m: int, out_dtype=jnp.bfloat16) -> jax.Array:
    """The same product in jnp on the dequantized operands (float32): tile i's rows times W[tile_group[i]]ᵀ."""
    tiles = xq.shape[0] // block_m
    x = (xq.astype(jnp.float32) * x_scale[:, None]).reshape(tiles, block_m, -1)
    e = jnp.maximum(tile_group, 0)
    w = wq[e].astype(jnp.float32) * w_scale[e][:, :, None]  # [tiles, N, K]
    y = jnp.einsum("tmk,tnk->tmn", x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    y = jnp.where((tile_group >= 0)[:, None, None], y, 0.0)
    return y.reshape(tiles * block_m, -1).astype(out_dtype)


def _kernel(group_ref, *refs, block_k: int, steps: int, gather: bool):
    row_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref = refs if gather else (None, *refs)
    g = group_ref[0]
    bm, bn = o_ref.shape
    rows = row_ref[...] if gather else slice(None)  # the tile's rows: gathered by token index, or its block
    zero_unused_tile(g, o_ref)

    @pl.when(g >= 0)
    def _():
        def body(t, acc):
            k0 = pl.multiple_of(t * block_k, block_k)
            xb = x_ref[rows, pl.ds(k0, block_k)]
            wb = w_ref[g, :, pl.ds(k0, block_k)]  # this program's bn columns of expert g, K-major
            return acc + pltriton.dot(xb, wb, trans_b=True)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = (acc * xs_ref[rows][:, None] * ws_ref[g, :][None, :]).astype(o_ref.dtype)


def grouped_fp8_matmul_tiles(xq: jax.Array, x_scale: jax.Array, wq: jax.Array, w_scale: jax.Array,
                             tile_group: jax.Array, *, tiles: GroupedFp8Tiles = GroupedFp8Tiles(),
                             out_dtype=jnp.bfloat16, interpret: bool = False,
                             row_token: jax.Array | None = None) -> jax.Array:
    """y [M, N] = (xq [M, K] * x_scale) tile by tile @ (wq[e] [N, K] * w_scale[e])ᵀ for e = tile_group[tile];
    `row_token` [M]: xq and x_scale are the tokens' [T, K] and [T], row r read at row_token[r] by the kernel."""
    gather = row_token is not None
    m, k = xq.shape if not gather else (row_token.shape[0], xq.shape[1])
    e, n, kw = wq.shape
    bm = tiles.block_m
    if xq.dtype not in FP8_FORMATS.values() or wq.dtype not in FP8_FORMATS.values():
        raise ValueError(f"grouped fp8 matmul wants float8 operands, got {xq.dtype} and {wq.dtype}")
    if m % bm or tile_group.shape != (m // bm,):
        raise ValueError(f"x has {m} rows: a multiple of block_m={bm} with one tile_group entry per tile expected")
    if kw != k or x_scale.shape != (xq.shape[0],) or w_scale.shape != (e, n):
        raise ValueError(f"x {xq.shape} (scales {x_scale.shape}) does not match the weights {wq.shape} (scales "
                         f"{w_scale.shape}): K must agree, scales [M] and [E, N]")
    bn, bk = tiles.block_n, tiles.block_k
    while bn > 16 and n % bn:
        bn //= 2
    while bk > 32 and k % bk:
        bk //= 2
    if n % bn or k % bk:
        raise ValueError(f"N={n} and K={k} must be multiples of 16 and 32 (the smallest FP8 tiles)")
    if gather:  # the tokens whole (read by index), the tile's token indices
        rows_specs = [pl.BlockSpec((bm,), lambda i, j: (i,)), pl.BlockSpec(xq.shape, lambda i, j: (0, 0)),
                      pl.BlockSpec(x_scale.shape, lambda i, j: (0,))]
        rows_args = (row_token.astype(jnp.int32), xq, x_scale.astype(jnp.float32))
    else:
        rows_specs = [pl.BlockSpec((bm, k), lambda i, j: (i, 0)), pl.BlockSpec((bm,), lambda i, j: (i,))]
        rows_args = (xq, x_scale.astype(jnp.float32))
    return pl.pallas_call(
        functools.partial(_kernel, block_k=bk, steps=k // bk, gather=gather),
        grid=(m // bm, n // bn),
        in_specs=[
            pl.BlockSpec((1,), lambda i, j: (i,)),
            *rows_specs,
            pl.BlockSpec((e, bn, k), lambda i, j: (0, j, 0)),
            pl.BlockSpec((e, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="grouped_fp8_matmul",
    )(tile_group.astype(jnp.int32), *rows_args, wq, w_scale.astype(jnp.float32))


def grouped_fp8_product(xq, x_scale, wq, w_scale, tile_group, tiles: GroupedFp8Tiles, out_dtype, impl: str,
                        row_token: jax.Array | None = None):
    """`grouped_fp8_matmul_tiles` (impl "pallas" or "pallas-interpret") or its reference ("xla"); `row_token`: the
    rows are the tokens' xq[row_token] (by index in the kernel)."""
    if impl == "xla":
        if row_token is not None:
            xq, x_scale = xq[row_token], x_scale[row_token]
        return grouped_fp8_matmul_reference(xq, x_scale, wq, w_scale, tile_group, tiles.block_m, out_dtype)
    return grouped_fp8_matmul_tiles(xq, x_scale, wq, w_scale, tile_group, tiles=tiles, out_dtype=out_dtype,
                                    interpret=impl == "pallas-interpret", row_token=row_token)


def e4m3_rows(a: jax.Array, impl: str) -> tuple[jax.Array, jax.Array]:
    """a's rows in e4m3 with a power-of-two scale each (the Pallas quantizer off the reference path: same bits)."""
    if impl == "xla":
        q, scale = quantize_rows_reference(a, "e4m3")
    else:
        q, scale = quantize_rows(a, "e4m3", interpret=impl == "pallas-interpret")
    return q, scale[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_fp8_matmul(x: jax.Array, frozen: tuple, tile_group: jax.Array, tiles: GroupedFp8Tiles = GroupedFp8Tiles(),
                       impl: str = "pallas") -> jax.Array:
    """y = x @ W[e]ᵀ per tile in FP8, x's dtype out: x [M, K] quantized per row to e4m3 here; `frozen` = (wq [E, N,
    K], w_scale [E, N], wtq [E, K, N], wt_scale [E, K]): W and Wᵀ in e4m3 with their scales. The input gradient
    dx = dy @ W[e] runs the same kernel on dy's e4m3 rows and Wᵀ; the weights get zero cotangents. `impl`:
    "pallas", "pallas-interpret" or "xla" (the reference)."""
    xq, x_scale = e4m3_rows(jax.lax.stop_gradient(x), impl)
    return grouped_fp8_product(xq, x_scale, frozen[0], frozen[1], tile_group, tiles, x.dtype, impl)


def _forward(x, frozen, tile_group, tiles, impl):
    return grouped_fp8_matmul(x, frozen, tile_group, tiles, impl), (frozen, tile_group)


def _backward(tiles, impl, residuals, dy):
    frozen, tile_group = residuals
    gq, g_scale = e4m3_rows(dy, impl)
    dx = grouped_fp8_product(gq, g_scale, frozen[2], frozen[3], tile_group, tiles, dy.dtype, impl)
    return dx, jax.tree.map(jnp.zeros_like, frozen), np.zeros(tile_group.shape, jax.dtypes.float0)


grouped_fp8_matmul.defvjp(_forward, _backward)
