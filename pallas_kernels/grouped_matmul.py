"""Grouped GEMM for mixture-of-experts layers in Pallas (Triton): each tile of rows times its own expert's weight.

Rows arrive grouped by expert and padded so that every tile of `block_m` rows belongs to one expert
(`jaxtune/moe/layout.py`); `tile_group[i]` names tile i's expert, -1 for an unused tile (written as zeros, no
GEMM). Forward: y[tile] = x[tile] @ W[e]ᵀ for HF-layout weights W [E, N, K]; input gradient: dx[tile] = dy[tile] @
W[e]. The weight block is read at a data-dependent expert index, which a BlockSpec cannot express: the weight's
block spans every expert and the kernel reads expert e's rows of it (`at_layer`'s pattern: no copy, only the
loaded tiles move). XLA's `ragged_dot` on the GPU computes every expert for every row (measured 1.2% of a dense
GEMM's rate at Qwen3-30B-A3B's 128 experts); this kernel does one expert's work per tile.

Also here: the jnp reference over the same tiles (`grouped_matmul_tiles_reference`) and the custom VJP (the weight
is frozen in QLoRA: its cotangent is zero; LoRA's adapters train through their own products). With `row_token` the
kernel reads each tile's rows from the token array by index (the routing's gather in the GEMM's loads), so the
routed rows [rows, hidden] are never written out: a forward product only, inside a caller's own VJP.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


@dataclass(frozen=True)
class GroupedTiles:
    """Measured on an H200 (benchmarks/results/2026-11-27-moe-h200.md): 128 x 256 x 64 tiles, 8 warps, the fastest
    of five at Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes but one (within 7% there)."""
    block_m: int = 128  # rows per tile: also the padding unit of each expert's group of rows
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


def grouped_matmul_tiles_reference(x: jax.Array, weight: jax.Array, tile_group: jax.Array, block_m: int,
                                   transpose: bool = False, row_token: jax.Array | None = None) -> jax.Array:
    """The same product in jnp: tile i's rows times weight[tile_group[i]]ᵀ (`transpose`: times weight[e]);
    unused tiles zero; `row_token`: the rows are x[row_token]."""
    if row_token is not None:
        x = x[row_token]
    tiles = x.shape[0] // block_m
    xt = x.reshape(tiles, block_m, x.shape[1])
    w = weight[jnp.maximum(tile_group, 0)]  # [tiles, N, K]
    spec = "tmk,tkn->tmn" if transpose else "tmk,tnk->tmn"
    y = jnp.einsum(spec, xt, w.astype(x.dtype), preferred_element_type=jnp.float32)
    y = jnp.where((tile_group >= 0)[:, None, None], y, 0.0)
    return y.reshape(tiles * block_m, -1).astype(x.dtype)


def zero_unused_tile(g: jax.Array, o_ref) -> None:
    """An unused tile (expert -1) is written as zeros, with no GEMM."""
    @pl.when(g < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _kernel(group_ref, *refs, block_k: int, steps: int, transpose: bool, gather: bool):
    row_ref, x_ref, w_ref, o_ref = refs if gather else (None, *refs)
    g = group_ref[0]
    bm, bn = o_ref.shape
    rows = row_ref[...] if gather else slice(None)  # the tile's rows of x: gathered by token index, or its block
    zero_unused_tile(g, o_ref)

    @pl.when(g >= 0)
    def _():
        def body(t, acc):
            k0 = t * block_k
            xb = x_ref[rows, pl.ds(k0, block_k)]
            # the weight's block already holds this program's bn output columns of every expert
            if transpose:  # W[e] rows are the contraction: block [bk, bn]
                wb = w_ref[g, pl.ds(k0, block_k), :].astype(xb.dtype)
                return acc + jnp.dot(xb, wb, preferred_element_type=jnp.float32)
            wb = w_ref[g, :, pl.ds(k0, block_k)].astype(xb.dtype)
            return acc + jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _fit(block: int, dim: int) -> int:
    """The largest power-of-two tile up to `block` that divides `dim` (16 at least, a tensor-core dot's minimum)."""
    while block > 16 and dim % block:
        block //= 2
    return min(block, dim)


def grouped_matmul_tiles(x: jax.Array, weight: jax.Array, tile_group: jax.Array, *, transpose: bool = False,
                         tiles: GroupedTiles = GroupedTiles(), interpret: bool = False,
                         row_token: jax.Array | None = None) -> jax.Array:
    """y [M, N] = each block_m-row tile of x [M, K] times weight[tile_group[i]]ᵀ (weight [E, N, K]), or with
    `transpose` times weight[tile_group[i]] (weight [E, K, N] read as [E, N, K]ᵀ: the input gradient).
    `row_token` [M]: x is the tokens [T, K] and row r is x[row_token[r]], loaded by index inside the kernel (the
    routed rows are never written out)."""
    m, k = x.shape if row_token is None else (row_token.shape[0], x.shape[1])
    e, rows_w, cols_w = weight.shape
    n, contraction = (cols_w, rows_w) if transpose else (rows_w, cols_w)
    bm = tiles.block_m
    if m % bm or tile_group.shape != (m // bm,):
        raise ValueError(f"x has {m} rows: a multiple of block_m={bm} with one tile_group entry per tile expected")
    if contraction != k:
        raise ValueError(f"x [.., {k}] does not contract with the expert weights {tuple(weight.shape)}")
    bn, bk = _fit(tiles.block_n, n), _fit(tiles.block_k, k)
    if n % bn or k % bk:
        raise ValueError(f"N={n} and K={k} must be multiples of 16 (the smallest tile)")
    w_block = (e, rows_w, bn) if transpose else (e, bn, cols_w)
    w_index = (lambda i, j: (0, 0, j)) if transpose else (lambda i, j: (0, j, 0))
    gather = row_token is not None
    rows_specs = [pl.BlockSpec((bm,), lambda i, j: (i,)), pl.BlockSpec(x.shape, lambda i, j: (0, 0))] if gather \
        else [pl.BlockSpec((bm, k), lambda i, j: (i, 0))]
    rows_args = (row_token.astype(jnp.int32), x) if gather else (x,)
    return pl.pallas_call(
        functools.partial(_kernel, block_k=bk, steps=k // bk, transpose=transpose, gather=gather),
        grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (i,)), *rows_specs, pl.BlockSpec(w_block, w_index)],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="grouped_matmul_gathered" if gather else "grouped_matmul",
    )(tile_group.astype(jnp.int32), *rows_args, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_matmul(x: jax.Array, weight: jax.Array, tile_group: jax.Array, tiles: GroupedTiles = GroupedTiles(),
                   interpret: bool = False) -> jax.Array:
    """y = x @ weight[e]ᵀ per tile (weight [E, N, K], frozen: its cotangent is zero), dx = dy @ weight[e]."""
    return grouped_matmul_tiles(x, weight, tile_group, tiles=tiles, interpret=interpret)


def _forward(x, weight, tile_group, tiles, interpret):
    return grouped_matmul_tiles(x, weight, tile_group, tiles=tiles, interpret=interpret), (weight, tile_group)


def _backward(tiles, interpret, residuals, dy):
    weight, tile_group = residuals
    dx = grouped_matmul_tiles(dy, weight, tile_group, transpose=True, tiles=tiles, interpret=interpret)
    return dx, jnp.zeros_like(weight), np.zeros(tile_group.shape, jax.dtypes.float0)


grouped_matmul.defvjp(_forward, _backward)


# LoRA's per-expert factor gradients by `grouped_weight_grad` (one kernel, no per-tile products written) rather
# than per-tile batched GEMMs summed per expert; off until measured on the device against them
# (benchmarks/moe/moe_grouped_gemm.py --weight-grad)
WEIGHT_GRAD_KERNEL = False


def bf16_parts(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A float32 array as a bf16 high part and the bf16 remainder: two tensor-core products of them, accumulated in
    float32, carry about 16 of its bits (one carries 8)."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def sum_per_expert(per_tile: jax.Array, tile_group: jax.Array, experts: int, full: bool = False) -> jax.Array:
    """[E, ...] float32: the sum of each expert's tiles of per_tile [T, ...] (float32; tile_group -1: in none).
    A GEMM with the tiles' one-hot expert matrix, since a scatter-add of the tiles into their experts' slots
    serializes on the few slots (measured 5 ms per layer at Qwen3-30B-A3B's shapes). For a 16-bit result the
    one-hot matrix (exact in bf16) multiplies per_tile split into a bf16 high part and a bf16 remainder: two
    tensor-core GEMMs accumulating in float32 carry about 16 bits of each term, where a float32 GEMM of full
    precision runs off the tensor cores (SIMT); `full`: that float32 GEMM (a float32 weight's gradient)."""
    flat = per_tile.reshape(per_tile.shape[0], -1)
    if full:
        one_hot = jax.nn.one_hot(tile_group, experts, dtype=jnp.float32)  # unused tiles (-1): all zeros
        total = jnp.einsum("te,tf->ef", one_hot, flat, precision=jax.lax.Precision.HIGHEST)
    else:
        one_hot = jax.nn.one_hot(tile_group, experts, dtype=jnp.bfloat16)
        total = sum(jnp.einsum("te,tf->ef", one_hot, part, preferred_element_type=jnp.float32)
                    for part in bf16_parts(flat))
    return total.reshape(experts, *per_tile.shape[1:])


def expert_tiles(tile_group: jax.Array, experts: int) -> tuple[jax.Array, jax.Array]:
    """(first tile, tile count) [E] of each expert: its tiles are contiguous in the layout (-1 tiles at the end)."""
    count = jnp.sum(tile_group[None, :] == jnp.arange(experts, dtype=tile_group.dtype)[:, None], axis=1,
                    dtype=jnp.int32)
    return jnp.cumsum(count) - count, count


def _weight_grad_kernel(first_ref, count_ref, dy_ref, x_ref, o_ref, *, block_m: int, exact: bool):
    """One expert's [bn, bk] block of dW = Σ over its tiles of dyᵀ x: a loop of run-time length over its tiles."""
    first = first_ref[0]

    def body(t, acc):
        r0 = pl.multiple_of((first + t) * block_m, block_m)
        dy, x = dy_ref[pl.ds(r0, block_m), :], x_ref[pl.ds(r0, block_m), :]
        return acc + pltriton.dot(dy, x, trans_a=True, allow_tf32=not exact)

    o_ref[...] = jax.lax.fori_loop(0, count_ref[0], body, jnp.zeros(o_ref.shape, jnp.float32))


def grouped_weight_grad(dy: jax.Array, x: jax.Array, tile_group: jax.Array, experts: int, block_m: int, *,
                        block_n: int = 64, block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
                        interpret: bool = False) -> jax.Array:
    """dW [E, N, K] float32, each expert's Σ over its tiles of dy[tile]ᵀ x[tile] (dy [M, N], x [M, K], rows
    grouped in `block_m`-row tiles as `tile_group` says): LoRA's per-expert factor gradient in one kernel, a
    program per (expert, N block, K block) accumulating in registers over the expert's tiles, so no per-tile
    products are written. An expert with no tiles gets zeros."""
    m, n = dy.shape
    k = x.shape[1]
    bn, bk = _fit(block_n, n), _fit(block_k, k)
    if m % block_m or tile_group.shape != (m // block_m,) or x.shape[0] != m or n % bn or k % bk:
        raise ValueError(f"dy {dy.shape} and x {x.shape}: rows in whole {block_m}-row tiles, one tile_group entry "
                         "each, and sizes that are multiples of 16 expected")
    first, count = expert_tiles(tile_group.astype(jnp.int32), experts)
    return pl.pallas_call(
        functools.partial(_weight_grad_kernel, block_m=block_m, exact=jnp.finfo(x.dtype).bits > 16),
        grid=(experts, n // bn, k // bk),
        in_specs=[pl.BlockSpec((1,), lambda e, j, q: (e,)), pl.BlockSpec((1,), lambda e, j, q: (e,)),
                  pl.BlockSpec((m, bn), lambda e, j, q: (0, j)), pl.BlockSpec((m, bk), lambda e, j, q: (0, q))],
        out_specs=pl.BlockSpec((None, bn, bk), lambda e, j, q: (e, j, q)),
        out_shape=jax.ShapeDtypeStruct((experts, n, k), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_weight_grad",
    )(first, count, dy, x)


def grouped_weight_grad_reference(dy: jax.Array, x: jax.Array, tile_group: jax.Array, experts: int,
                                  block_m: int) -> jax.Array:
    """The same sums in jnp: each tile's product (a batched GEMM), summed per expert (`sum_per_expert`)."""
    count = tile_group.shape[0]
    per_tile = jnp.einsum("tmn,tmk->tnk", dy.reshape(count, block_m, -1), x.reshape(count, block_m, -1),
                          preferred_element_type=jnp.float32)
    return sum_per_expert(per_tile, tile_group, experts, full=jnp.finfo(x.dtype).bits > 16)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def grouped_matmul_trainable(x: jax.Array, weight: jax.Array, tile_group: jax.Array,
                             tiles: GroupedTiles = GroupedTiles(), interpret: bool = False) -> jax.Array:
    """`grouped_matmul` for a trained weight (LoRA's per-expert factors): dW[e] = Σ over e's tiles of dyᵀ x, each
    tile's product a batched GEMM in XLA, summed per expert by a GEMM with the tiles' one-hot expert matrix."""
    return grouped_matmul_tiles(x, weight, tile_group, tiles=tiles, interpret=interpret)


def _trainable_forward(x, weight, tile_group, tiles, interpret):
    return grouped_matmul_tiles(x, weight, tile_group, tiles=tiles, interpret=interpret), (x, weight, tile_group)


def _trainable_backward(tiles, interpret, residuals, dy):
    x, weight, tile_group = residuals
    dx = grouped_matmul_tiles(dy, weight, tile_group, transpose=True, tiles=tiles, interpret=interpret)
    if WEIGHT_GRAD_KERNEL:
        dw = grouped_weight_grad(dy, x, tile_group, weight.shape[0], tiles.block_m, interpret=interpret)
    else:
        dw = grouped_weight_grad_reference(dy, x, tile_group, weight.shape[0], tiles.block_m)
    return dx, dw.astype(weight.dtype), np.zeros(tile_group.shape, jax.dtypes.float0)


grouped_matmul_trainable.defvjp(_trainable_forward, _trainable_backward)
