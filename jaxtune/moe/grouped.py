"""One GEMM over all experts: the routed rows, grouped by expert in whole tiles (`layout.TileLayout`), each
times its own expert's weight.

Dropless: every routed row is computed, however uneven the groups (empty ones included), with no capacity
factor, no Python loop over experts and no dense all-experts product. On the GPU the Pallas kernel
(pallas_kernels/grouped_matmul.py) runs one expert's GEMM per tile (on Hopper, where `dispatch.moe_frozen_impl`
says so, the frozen experts' products run through JAX's Mosaic GPU ragged dot instead: wgmma); elsewhere (and
under JAXTUNE_KERNELS=xla) `jax.lax.ragged_dot`, which XLA's GPU backend computes for every expert on every row
(1.2% of a dense GEMM's rate at Qwen3-30B-A3B's shapes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.moe.layout import TileLayout
from jaxtune.ops import dispatch
from jaxtune.parallel.sharding import current_mesh


def grouped_matmul(x: jax.Array, weight: jax.Array, layout: TileLayout, *, trainable: bool = False,
                   out_dtype: jnp.dtype | None = None) -> jax.Array:
    """y[rows of expert e] = x[rows of expert e] @ weight[e].T for HF-layout expert weights [E, out, in]; x [rows,
    in] in `layout`'s padded order (padding rows give zeros). float32 accumulation, x's dtype (or `out_dtype`) out.
    `trainable`: the weight's gradient is computed (LoRA's factors); otherwise it is frozen (zero cotangent on the
    kernel path)."""
    weight = weight.astype(x.dtype)
    if not trainable and dispatch.moe_frozen_impl() == "wgmma" and current_mesh() is None:
        from pallas_kernels.grouped_matmul_wgmma import fits, frozen_ragged_matmul

        if fits(weight.shape[2], weight.shape[1]):
            return frozen_ragged_matmul(x, weight, layout.group_sizes).astype(out_dtype or x.dtype)
    if dispatch.moe_impl() == "pallas":
        from pallas_kernels.grouped_matmul import GroupedTiles, grouped_matmul as frozen, grouped_matmul_trainable

        fn = grouped_matmul_trainable if trainable else frozen
        y = fn(x, weight, layout.tile_group, GroupedTiles(block_m=layout.block_m), dispatch.interpret())
    else:
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        y = jax.lax.ragged_dot_general(x, weight, layout.group_sizes, dims, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def grouped_matmul_input_grad(dy: jax.Array, weight: jax.Array, layout: TileLayout) -> jax.Array:
    """dx[rows of expert e] = dy[rows of expert e] @ weight[e] for frozen HF-layout weights [E, out, in]: the
    input gradient of `grouped_matmul` (dy [rows, out] in `layout`'s order), float32 accumulation, dy's dtype."""
    weight = weight.astype(dy.dtype)
    if dispatch.moe_frozen_impl() == "wgmma" and current_mesh() is None:
        from pallas_kernels.grouped_matmul_wgmma import fits, ragged_matmul

        if fits(weight.shape[1], weight.shape[2]):
            return ragged_matmul(dy, weight, layout.group_sizes, transpose=True)
    if dispatch.moe_impl() == "pallas":
        from pallas_kernels.grouped_matmul import GroupedTiles, grouped_matmul_tiles

        return grouped_matmul_tiles(dy, weight, layout.tile_group, transpose=True,
                                    tiles=GroupedTiles(block_m=layout.block_m), interpret=dispatch.interpret())
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (1,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(dy, weight, layout.group_sizes, dims,
                                      preferred_element_type=jnp.float32).astype(dy.dtype)


def gathered_matmul(tokens: jax.Array, row_token: jax.Array, weight: jax.Array, layout: TileLayout, *,
                    trainable: bool = False) -> jax.Array:
    """`grouped_matmul` of the rows tokens[row_token] (tokens [T, in], row_token [rows] in `layout`'s order), a
    forward product only (inside a caller's own VJP): the Pallas kernel loads each tile's rows by index, so the
    [rows, in] copy is never written; elsewhere (XLA's ragged_dot, the wgmma kernel, a mesh) the rows are gathered
    first. Padding rows read token 0: their products are not zeros, and nothing may read them."""
    wgmma = not trainable and dispatch.moe_frozen_impl() == "wgmma"
    if dispatch.moe_impl() == "pallas" and current_mesh() is None and not wgmma:
        from pallas_kernels.grouped_matmul import GroupedTiles, grouped_matmul_tiles

        return grouped_matmul_tiles(tokens, weight.astype(tokens.dtype), layout.tile_group,
                                    tiles=GroupedTiles(block_m=layout.block_m), interpret=dispatch.interpret(),
                                    row_token=row_token)
    return grouped_matmul(tokens[row_token], weight, layout, trainable=trainable)
