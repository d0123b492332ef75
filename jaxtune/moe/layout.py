"""Where each routed row goes for the grouped GEMMs: grouped by expert, each expert's group padded to whole tiles.

With every tile of `block_m` rows inside one expert's group, a tile is one expert's GEMM (the Pallas kernel reads
that expert's weight) and the padding costs at most block_m - 1 rows per expert. The row count is fixed by the
shapes alone (routed rows + experts * (block_m - 1), rounded up to a tile), so one compiled step serves every
routing."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

BLOCK_M = 128  # the grouped kernel's tile rows (pallas_kernels/grouped_matmul.py)


class TileLayout(NamedTuple):
    position: jax.Array  # [N*k] the padded row of each routed row (token * k + slot)
    tile_group: jax.Array  # [rows / block_m] each tile's expert, -1 past the last used tile
    group_sizes: jax.Array  # [E] each expert's padded row count (a multiple of block_m; zero for unused experts)
    rows: int  # the padded row count (static)
    block_m: int


def padded_rows(routed: int, experts: int, block_m: int = BLOCK_M) -> int:
    """The most rows the padded groups can take: every expert's last tile partly empty."""
    return -(-(routed + experts * (block_m - 1)) // block_m) * block_m


def tile_layout(experts: jax.Array, num_experts: int, block_m: int = BLOCK_M) -> TileLayout:
    """The padded layout of the rows routed to `experts` [N, k] (each token's experts)."""
    flat = experts.reshape(-1).astype(jnp.int32)
    routed = flat.shape[0]
    rows = padded_rows(routed, num_experts, block_m)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    padded = -(-sizes // block_m) * block_m
    padded_start = jnp.cumsum(padded) - padded
    start = jnp.cumsum(sizes) - sizes
    order = jnp.argsort(flat, stable=True)
    in_order = flat[order]
    rank = jnp.arange(routed, dtype=jnp.int32) - start[in_order]  # place within the expert's group
    position = jnp.zeros((routed,), jnp.int32).at[order].set(padded_start[in_order] + rank)
    tile_start = jnp.arange(rows // block_m, dtype=jnp.int32) * block_m
    ends = jnp.cumsum(padded)
    group = jnp.searchsorted(ends, tile_start, side="right").astype(jnp.int32)
    tile_group = jnp.where(tile_start < ends[-1], group, -1)
    return TileLayout(position, tile_group, padded, rows, block_m)


def row_tokens(layout: TileLayout, top_k: int) -> jax.Array:
    """[rows] the token each padded row is a copy of (padding rows: token 0, whose products nothing reads)."""
    routed = layout.position.shape[0]
    return jnp.zeros((layout.rows,), jnp.int32).at[layout.position].set(
        jnp.arange(routed, dtype=jnp.int32) // top_k, unique_indices=True)
