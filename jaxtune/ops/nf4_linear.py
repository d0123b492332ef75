"""A frozen NF4 projection in the model's dtype (bf16): XLA's dequantize-then-dot, the fused Pallas kernel, or
the Pallas dequant kernel + cuBLAS. Each VJP gives dx only (W is frozen) and saves just the 4-bit arrays for
the backward pass, never a dequantized copy of W."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtune.ops.context import barrier
from jaxtune.ops.dense import input_gradient, linear, rows, zero_cotangent
from jaxtune.ops.kernel_operands import dequantized, kernel_shaped, layer_on_every_device, with_codes
from jaxtune.quant.nf4 import dequantize

# decoding's few rows on the CUDA cores: (block_n, block_bytes, split, num_warps) by rows and by the weight's N (at
# least), the fastest tile of each Llama-3-8B shape on the H200 (benchmarks/results/2026-11-24-decode-gemv-h200.md)
GEMV_TILES = {
    1: ((8192, (32, 64, 4, 4)), (4096, (64, 64, 8, 4)), (0, (64, 64, 16, 4))),
    4: ((8192, (64, 32, 4, 4)), (4096, (32, 64, 4, 4)), (0, (16, 64, 16, 2))),
}


def kernel_tiles(m: int, direction: str, shape: tuple[int, int] | None = None, dtype=jnp.bfloat16):
    """The fused kernels' tiles for M rows of a weight [N, K]: up to 4 rows forward (decoding) on the CUDA cores
    (1.1-1.7x the tensor-core tile there), by N; tensor-core tiles otherwise, for rows of `dtype`. float32 rows take
    the 64-row tile past 64 rows: the 256- and 128-row tiles' three stages of 4-byte rows ask more shared memory than
    an H100 has (313 KB, measured on an H200)."""
    from pallas_kernels.nf4_matmul import MatmulTiles

    if jnp.dtype(dtype).itemsize >= 4 and m > 64:
        return MatmulTiles(64, 64, 64, 2, 4, 3)
    n, k = shape or (0, 0)
    if m <= 4 and direction == "fwd":
        tile_rows = 1 if m == 1 else 4
        block_n, block_bytes, split, warps = next(t for at_least, t in GEMV_TILES[tile_rows] if n >= at_least)
        return MatmulTiles(tile_rows, block_n, block_bytes, split, warps, 3, lut="gather", gemv=True)
    permute = jnp.dtype(dtype) == jnp.bfloat16 and direction == "fwd"  # bf16 tables: bf16 rows only
    if m <= 16 and permute:
        # decoding: the weight as the dot's left operand, decoded through bf16 tables by byte permutes; 1.16-1.57x
        # the select-tree tile at Llama-3-8B's four shapes on an H200
        # (benchmarks/results/2026-11-28-grpo-dense-rollout-h200.md)
        return MatmulTiles(16, 64, 64 if 0 < n <= 4096 and k <= 4096 else 32, 4, 4, 3, lut="permute",
                           weight_first=True)
    if m <= 64 and permute:
        # 17-64 rows (dispatch.NF4_TABLE): 1.35-1.56x dequantize + cuBLAS at 8B's N >= 4096 (0.84x at N = 1024)
        return MatmulTiles(64, 64, 32, 4, 4, 3, lut="permute", weight_first=0 < n < 4096)
    if m <= 16:
        return MatmulTiles(16, 64, 32, 8, 4, 3)
    if m <= 256:
        return MatmulTiles(64, 64, 64, 2, 4, 3)
    return MatmulTiles(256, 128, 64, 1, 8, 3) if direction == "fwd" else MatmulTiles(128, 128, 64, 1, 8, 3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _xla_nf4_matmul(x: jax.Array, weight, at_use: bool) -> jax.Array:
    x, weight = barrier(at_use, x, weight)
    return linear(x, dequantize(layer_on_every_device(weight), x.dtype))


def _xla_nf4_matmul_fwd(x, weight, at_use):
    return _xla_nf4_matmul(x, weight, at_use), weight


def _xla_nf4_matmul_bwd(at_use, weight, dy):
    weight, dy = barrier(at_use, weight, dy)
    return input_gradient(dy, dequantize(layer_on_every_device(weight), dy.dtype)), jax.tree.map(zero_cotangent, weight)


_xla_nf4_matmul.defvjp(_xla_nf4_matmul_fwd, _xla_nf4_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _kernel_nf4_matmul(x, weight, impl: str, interpret: bool, at_use: bool):
    from pallas_kernels import nf4_matmul as kernels

    x, weight = barrier(at_use, x, weight)
    if impl == "fused":
        tiles = kernel_tiles(rows(x), "fwd", weight.shape, x.dtype)
        return with_codes(weight, functools.partial(kernels.nf4_matmul_forward, tiles=tiles, interpret=interpret), x)
    return linear(x, dequantized(weight, x.dtype, interpret))


def _kernel_nf4_matmul_fwd(x, weight, impl, interpret, at_use):
    return _kernel_nf4_matmul(x, weight, impl, interpret, at_use), weight


def _kernel_nf4_matmul_bwd(impl, interpret, at_use, weight, dy):
    from pallas_kernels import nf4_matmul as kernels

    weight, dy = barrier(at_use, weight, dy)
    if impl == "fused":
        tiles = kernel_tiles(rows(dy), "dx", dtype=dy.dtype)
        dx = with_codes(weight, functools.partial(kernels.nf4_matmul_dx, tiles=tiles, interpret=interpret), dy)
    else:
        dx = input_gradient(dy, dequantized(weight, dy.dtype, interpret))
    return dx.astype(dy.dtype), jax.tree.map(zero_cotangent, weight)


_kernel_nf4_matmul.defvjp(_kernel_nf4_matmul_fwd, _kernel_nf4_matmul_bwd)


def bf16_nf4_matmul(x: jax.Array, weight, impl: str, interpret: bool, at_use: bool = False) -> jax.Array:
    """The projection in x's dtype: a Pallas path (`impl` "fused" or "dequant+dot") where the weight's shape
    suits the kernels, else dequantize then dot. `at_use`: dequantize at use (`context.dequantize_at_use`)."""
    if impl != "xla" and kernel_shaped(weight):
        return _kernel_nf4_matmul(x, weight, impl, interpret, at_use)
    return _xla_nf4_matmul(x, weight, at_use)


def dense_nf4_weight(weight, dtype) -> jax.Array:
    """W [out, in] in dtype, dequantized as the projection's "dequantize, then dot" path dequantizes it (the Pallas
    kernel where the weight's shape suits it and kernels run, else XLA): the same bits, for a caller that reads the
    weight for many tokens (a sampler) and dequantizes it once."""
    from jaxtune.ops import dispatch

    if dispatch.nf4_dequant_impl() == "pallas" and kernel_shaped(weight):
        return dequantized(weight, dtype, dispatch.interpret())
    return dequantize(layer_on_every_device(weight), dtype)
