"""MXFP4 (the OCP microscaling 4-bit float), as gpt-oss's published checkpoints store their experts: blocks of 32
E2M1 values, two per byte (the low nibble first), each block scaled by a power of two stored as a biased 8-bit
exponent (E8M0, bias 127). Read only: jaxtune dequantizes MXFP4 at load and quantizes the result to NF4."""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32  # values per scale
E8M0_BIAS = 127
# the 16 E2M1 codes: sign bit 3, then two exponent bits and one mantissa bit
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """[..., groups, 16] uint8 codes and [..., groups] uint8 exponents -> [..., groups * 32] values.

    bfloat16 holds every MXFP4 value exactly (two significant bits, float32's exponent range), so the default
    loses nothing and takes half the memory of float32."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair: blocks must be "
                         f"[..., groups, {BLOCK // 2}] and scales [..., groups]")
    values = np.empty((*blocks.shape[:-1], BLOCK), np.float32)
    values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
    values[..., 1::2] = E2M1_VALUES[blocks >> 4]
    exponents = scales.astype(np.int32)[..., None] - E8M0_BIAS
    return np.ldexp(values, exponents).astype(dtype).reshape(*blocks.shape[:-2], -1)
