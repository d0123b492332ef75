"""Which arrays a Pallas GPU (Triton) kernel can address whole.

Pallas' Triton lowering computes an operand's element offsets in 32 bits unless the operand is larger than
4 GiB, and Triton adds an offset to a pointer as a signed number. An operand of more than 2^31 elements that is
not larger than 4 GiB (only 1-byte types qualify: NF4 codes, FP8 values) is therefore read and written at
negative offsets past its first 2^31 elements: out of bounds, either a CUDA illegal-address error or another
buffer's bytes read without an error. Llama-3-70B's q_proj and o_proj codes stacked over 80 layers (80 x 8192 x
4096 bytes, 2.5 GiB) and Qwen3-32B's MLP codes (64 x 25600 x 2560 bytes, 3.9 GiB) are such operands. The
dequant kernels read them as uint16 pairs of bytes (half the elements: every stack up to 4 GiB is addressed whole);
the fused matmuls and FP8 kernels take them in pieces below the limit.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

OFFSET_LIMIT = 2**31  # elements a signed 32-bit offset reaches (0 .. 2^31 - 1)
WIDE_OFFSETS_ABOVE = 2**32  # bytes past which the lowering switches to 64-bit offsets


def addressable(shape: tuple[int, ...], dtype) -> bool:
    """Whether a kernel operand of this shape and dtype has every element at a correct offset."""
    size = math.prod(shape)
    return size <= OFFSET_LIMIT or size * jnp.dtype(dtype).itemsize > WIDE_OFFSETS_ABOVE


def addressable_rows(rows: int, row_shape: tuple[int, ...], dtype) -> int:
    """The most rows (at most `rows`, at least one) of [rows, *row_shape] that one call can address."""
    if addressable((rows, *row_shape), dtype):
        return rows
    return max(1, OFFSET_LIMIT // math.prod(row_shape))
