"""FP8 GEMM with fine-grained scaling for GPU in Pallas (Triton): y = dequant(aq) @ dequant(bq)ᵀ.

Both operands are K-major float8 matrices (aq [M, K], bq [N, K]: the layout Hopper's FP8 tensor cores take)
with one float32 scale per (row, K-block): a ≈ aq * a_scale and b ≈ bq * b_scale blockwise. The kernel walks K
one scale block at a time, forms the block's FP8 product on the tensor cores with f32 accumulation, and adds
it to the f32 accumulator times the outer product of the two blocks' scales; the result is written in bf16.

Scales are powers of two, so applying them is exact: a dequantized block (an FP8 value times 2^e) is
representable in bf16 and float32, and the jnp reference (dequantize, then an f32 dot) computes the same
sum up to summation order. The quantizer both sides use is `pallas_kernels.fp8_quantize`.

For QLoRA the same kernel serves the forward projection (a = activations, b = W [out, in]) and the input
gradient (a = dy, b = Wᵀ [in, out]), each operand scaled along its own contraction axis.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.addressing import addressable, addressable_rows
from pallas_kernels.fp8_quantize import FP8_FORMATS, dequantize_blocks


@dataclasses.dataclass(frozen=True)
class Fp8Tiles:
    """Output tile, K step (a divisor of the scale block), launch parameters."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 4


# ------------------------------------------------------------------------------------------- reference


def fp8_matmul_reference(aq: jax.Array, a_scale: jax.Array, bq: jax.Array, b_scale: jax.Array,
                         out_dtype=jnp.bfloat16) -> jax.Array:
    """dequant(aq) [..., K] @ dequant(bq)ᵀ [K, N] in float32, rounded once to out_dtype."""
    a = dequantize_blocks(aq, a_scale)
    b = dequantize_blocks(bq, b_scale)
    dims = (((a.ndim - 1,), (1,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                               precision=jax.lax.Precision.HIGHEST).astype(out_dtype)


# --------------------------------------------------------------------------------------------- kernel


def _kernel(a_ref, a_scale_ref, b_ref, b_scale_ref, y_ref, *, scale_block: int, block_k: int, blocks: int):
    """y tile [bm, bn] = sum over scale blocks of (a_blk @ b_blkᵀ) * a_scale[:, blk] * b_scale[:, blk], each
    block's product accumulated in f32 over K steps of `block_k` on the tensor cores."""
    bm, bn = y_ref.shape
    inner = scale_block // block_k

    def block_product(blk):
        def step(t, partial):
            k0 = pl.multiple_of(blk * scale_block + t * block_k, block_k)
            a = a_ref[:, pl.ds(k0, block_k)]
            b = b_ref[:, pl.ds(k0, block_k)]
            return partial + pltriton.dot(a, b, trans_b=True)

        return jax.lax.fori_loop(0, inner, step, jnp.zeros((bm, bn), jnp.float32))

    def scaled(blk, product):
        return product * (a_scale_ref[blk, :][:, None] * b_scale_ref[blk, :][None, :])

    if blocks == 1:  # one scale per row: a plain FP8 GEMM, scaled once in the epilogue
        acc = scaled(0, block_product(0))
    else:
        acc = jax.lax.fori_loop(0, blocks, lambda blk, acc: acc + scaled(blk, block_product(blk)),
                                jnp.zeros((bm, bn), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def _check(aq, a_scale, bq, b_scale) -> int:
    m_k, (n, k) = aq.shape[-1], bq.shape
    if aq.dtype not in FP8_FORMATS.values() or bq.dtype not in FP8_FORMATS.values():
        raise ValueError(f"fp8 matmul wants float8 operands, got {aq.dtype} and {bq.dtype}")
    if m_k != k:
        raise ValueError(f"a has K={m_k} but b has K={k}")
    nblocks = b_scale.shape[-1]
    if nblocks == 0 or k % nblocks or (k // nblocks) % 64:
        raise ValueError(f"scales must cover K={k} in equal blocks of a multiple of 64 columns")
    block = k // nblocks
    if a_scale.shape != (*aq.shape[:-1], nblocks) or b_scale.shape != (n, nblocks):
        raise ValueError(f"scales must be [rows, K/{block}]: got {a_scale.shape} and {b_scale.shape}")
    if n % 64:
        raise ValueError(f"fp8 matmul needs N a multiple of 64, got {n}")
    return block


def fp8_matmul(aq: jax.Array, a_scale: jax.Array, bq: jax.Array, b_scale: jax.Array, *,
               tiles: Fp8Tiles = Fp8Tiles(), out_dtype=jnp.bfloat16, interpret: bool = False) -> jax.Array:
    """y [..., N] = dequant(aq) [..., K] @ dequant(bq)ᵀ with block scales (see the module doc)."""
    block = _check(aq, a_scale, bq, b_scale)
    lead, k = aq.shape[:-1], aq.shape[-1]
    n = bq.shape[0]
    a2, s2 = aq.reshape(-1, k), a_scale.reshape(-1, k // block)
    m = a2.shape[0]
    if not addressable(bq.shape, bq.dtype):
        raise ValueError(f"fp8 matmul: b {bq.shape} has more than 2^31 elements; split its rows (N) over calls")
    per_call = addressable_rows(m, (k,), aq.dtype)
    if per_call < m:  # a of 2^31+ elements: rows in calls the kernel addresses correctly
        y = jnp.concatenate([fp8_matmul(a2[i:i + per_call], s2[i:i + per_call], bq, b_scale, tiles=tiles,
                                        out_dtype=out_dtype, interpret=interpret) for i in range(0, m, per_call)])
        return y.reshape(*lead, n)
    bm = min(tiles.block_m, max(16, pl.next_power_of_2(m)))
    bn = tiles.block_n
    while n % bn:
        bn //= 2
    mp = pl.cdiv(m, bm) * bm
    if mp != m:
        a2 = jnp.pad(a2, ((0, mp - m), (0, 0)))
        s2 = jnp.pad(s2, ((0, mp - m), (0, 0)), constant_values=1.0)
    steps = k // block
    block_k = tiles.block_k
    while block % block_k:
        block_k //= 2
    y = pl.pallas_call(
        functools.partial(_kernel, scale_block=block, block_k=block_k, blocks=steps),
        grid=(mp // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((steps, bm), lambda i, j: (0, i)),
            pl.BlockSpec((bn, k), lambda i, j: (j, 0)),
            pl.BlockSpec((steps, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name="fp8_blockscaled_matmul",
    )(a2, s2.T, bq, b_scale.T)
    return y[:m].reshape(*lead, n)
