"""Grouped GEMM for mixture-of-experts layers on Hopper: JAX's Mosaic GPU ragged dot (wgmma with TMA loads,
jax.experimental.pallas.ops.gpu.ragged_dot_mgpu), wrapped for the frozen expert weights of QLoRA.

The Triton kernel beside it (grouped_matmul.py) reaches 64-67% of a dense cuBLAS GEMM at Qwen3-30B-A3B's narrow
experts: Triton does not emit wgmma from Pallas there. JAX's own Mosaic GPU kernel issues wgmma from shared memory
filled by TMA, the instructions CUTLASS's grouped GEMM uses. It takes rows grouped by expert and the group sizes,
so the padded layout of jaxtune/moe/layout.py serves it as it is (padding rows are zeros and give zeros).

Forward: y = x @ W[e]ᵀ for HF-layout weights W [E, N, K] (the kernel reads W[e] transposed from shared memory);
input gradient: dx = dy @ W[e] (W [E, N, K] read as the kernel's [G, K', N']). The weight is frozen: its
cotangent is zero. Here too: the reference (`ragged_matmul_reference`, jax.lax.ragged_dot in float32).

No interpreter runs Mosaic GPU kernels on a CPU, so its tests are the CUDA lowering on CPU and a compiled check
on the GPU against float64 (tests/test_kernel_grouped_wgmma.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class WgmmaTiles:
    """One output tile per SM step: block_m rows x block_n columns, block_k deep per pipeline stage;
    `stages` tiles in flight (TMA ahead of wgmma); `grid_block_n` column tiles walked together (L2 reuse)."""
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 1


def fits(k: int, n: int, tiles: WgmmaTiles = WgmmaTiles()) -> bool:
    """Whether the kernel takes a product contracting K into N columns: whole blocks both ways."""
    return k % tiles.block_k == 0 and n % (tiles.block_n * tiles.grid_block_n) == 0


def ragged_matmul_reference(x: jax.Array, weight: jax.Array, group_sizes: jax.Array,
                            transpose: bool = False) -> jax.Array:
    """The same product by jax.lax.ragged_dot: x's rows in groups of `group_sizes` (the rest zero), group e times
    weight[e]ᵀ (`transpose`: times weight[e]), float32 accumulation, x's dtype out."""
    w = weight if transpose else jnp.swapaxes(weight, 1, 2)
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def ragged_matmul(x: jax.Array, weight: jax.Array, group_sizes: jax.Array, *, transpose: bool = False,
                  tiles: WgmmaTiles = WgmmaTiles()) -> jax.Array:
    """y [M, N] = each group of x's rows times weight[e]ᵀ (weight [E, N, K]), or with `transpose` times weight[e]
    (weight [E, K, N] read as [E, N, K]ᵀ: the input gradient). Rows past sum(group_sizes) are zeros: the kernel
    leaves them unwritten, and a NaN there would reach the gradients through 0 * NaN."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, k = x.shape
    e, rows_w, cols_w = weight.shape
    n, contraction = (cols_w, rows_w) if transpose else (rows_w, cols_w)
    if contraction != k:
        raise ValueError(f"x [.., {k}] does not contract with the expert weights {tuple(weight.shape)}")
    if group_sizes.shape != (e,):
        raise ValueError(f"{e} experts need {e} group sizes, got shape {tuple(group_sizes.shape)}")
    if not fits(k, n, tiles):
        raise ValueError(f"K={k} and N={n} must be multiples of {tiles.block_k} and "
                         f"{tiles.block_n * tiles.grid_block_n} (the wgmma tiles)")
    group_sizes = group_sizes.astype(jnp.int32)
    y = ragged_dot_mgpu.ragged_dot(
        x, weight.astype(x.dtype), group_sizes=group_sizes, block_m=tiles.block_m, block_n=tiles.block_n,
        block_k=tiles.block_k, max_concurrent_steps=tiles.stages, grid_block_n=tiles.grid_block_n,
        transpose_rhs=not transpose)
    written = jnp.arange(m, dtype=jnp.int32)[:, None] < jnp.sum(group_sizes)
    return jnp.where(written, y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def frozen_ragged_matmul(x: jax.Array, weight: jax.Array, group_sizes: jax.Array,
                         tiles: WgmmaTiles = WgmmaTiles()) -> jax.Array:
    """y = x @ weight[e]ᵀ per group (weight [E, N, K], frozen: its cotangent is zero), dx = dy @ weight[e]."""
    return ragged_matmul(x, weight, group_sizes, tiles=tiles)


def _forward(x, weight, group_sizes, tiles):
    return ragged_matmul(x, weight, group_sizes, tiles=tiles), (weight, group_sizes)


def _backward(tiles, residuals, dy):
    weight, group_sizes = residuals
    dx = ragged_matmul(dy, weight, group_sizes, transpose=True, tiles=tiles)
    return dx, jnp.zeros_like(weight), np.zeros(group_sizes.shape, jax.dtypes.float0)


frozen_ragged_matmul.defvjp(_forward, _backward)
