"""Row-wise FP8 quantization in one pass for GPU in Pallas (Triton), and the jnp reference it matches bit for bit.

An FP8 GEMM's activation or output-gradient operand is quantized with one power-of-two scale per row: the
row's absolute maximum picks the scale, then every value is divided by it and rounded. Left to XLA that is a
row reduction fused into the tensor's producer (a multi-output reduction fusion, measured much slower than the
plain elementwise producer) and a second pass that reads the tensor again to cast it. The kernel here reads each
bf16 row once, keeps it in registers while it takes the maximum, and writes e4m3 and the row's scale.

Scales are exact powers of two, so a / scale is exact and the only rounding is the cast to FP8 (round to
nearest even). They are computed from exponent bits: the smallest 2^e >= amax / max_finite, where every FP8
format's max_finite is 1.75 * 2^F, is 2^(E - F) for amax = m * 2^E with m <= 1.75 and 2^(E - F + 1) otherwise;
at least 2^-126 (the smallest normal float32, so 1 / scale stays finite), and 1 for a row whose maximum is
zero or a float32 subnormal (backends that flush subnormals see zero there anyway).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.addressing import addressable_rows

FP8_FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
E4M3 = jnp.float8_e4m3fn
_MIN_EXPONENT = -126


def fp8_dtype(fmt: str):
    if fmt not in FP8_FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; use one of {', '.join(FP8_FORMATS)}")
    return FP8_FORMATS[fmt]


def _max_exponent(dtype) -> int:
    """F with the format's largest finite value = 1.75 * 2^F (448 = 1.75 * 2^8, 57344 = 1.75 * 2^15)."""
    fmax = float(jnp.finfo(dtype).max)
    f = round(math.log2(fmax / 1.75))
    if 1.75 * 2.0**f != fmax:
        raise ValueError(f"{jnp.dtype(dtype).name}: largest finite value {fmax} is not 1.75 * 2^F")
    return f


def _pow2_scale_and_inverse(amax: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(2^e, 2^-e) as float32 for amax >= 0 (float32): see the module doc. Integer ops only, so the same
    bits come out of XLA on any backend and of the Triton kernel."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    above = (bits & 0x7FFFFF) > 0x600000  # mantissa > 1.75
    e = exponent - _max_exponent(dtype) + above.astype(jnp.int32)
    e = jnp.where(exponent > -127, jnp.maximum(e, _MIN_EXPONENT), 0)  # zero and float32 subnormals: 1
    scale = jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)
    inverse = jax.lax.bitcast_convert_type((127 - e) << 23, jnp.float32)
    return scale, inverse


def pow2_scale(amax: jax.Array, dtype=E4M3) -> jax.Array:
    """The smallest power of two s >= 2^-126 with amax / s <= the format's largest finite value (1 where amax
    is 0 or below 2^-126)."""
    return _pow2_scale_and_inverse(amax.astype(jnp.float32), dtype)[0]


# ------------------------------------------------------------------------------------------- reference


def quantize_blocks(a: jax.Array, block: int | None = None, fmt: str = "e4m3") -> tuple[jax.Array, jax.Array]:
    """(aq [..., K] float8, scale [..., K / block] float32) with a ≈ aq * scale per block of `block` columns
    (None: one block per row, scale [..., 1]). XLA's version (fused into a's producer)."""
    dtype = fp8_dtype(fmt)
    k = a.shape[-1]
    block = k if block is None else block
    if k % block:
        raise ValueError(f"the last axis ({k}) must be a multiple of the scale block {block}")
    fmax = float(jnp.finfo(dtype).max)
    blocks = a.astype(jnp.float32).reshape(*a.shape[:-1], k // block, block)
    scale, inverse = _pow2_scale_and_inverse(jnp.max(jnp.abs(blocks), axis=-1), dtype)
    q = jnp.clip(blocks * inverse[..., None], -fmax, fmax).astype(dtype)
    return q.reshape(a.shape), scale


def dequantize_blocks(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """q * scale per block (exact in float32 and bf16: the scale is a power of two)."""
    k = q.shape[-1]
    block = k // scale.shape[-1]
    blocks = q.astype(jnp.float32).reshape(*q.shape[:-1], k // block, block) * scale[..., None]
    return blocks.reshape(q.shape).astype(dtype)


def quantize_rows_reference(a: jax.Array, fmt: str = "e4m3") -> tuple[jax.Array, jax.Array]:
    """quantize_blocks(a, None, fmt): one power-of-two scale per row."""
    return quantize_blocks(a, None, fmt)


# --------------------------------------------------------------------------------------------- kernel


def _kernel(x_ref, q_ref, s_ref, *, chunk: int, fmax: float, dtype):
    """A block of rows, read once: the chunks' loads are unrolled (all in flight together) and kept in
    registers for the rows' |max|, then scaled, rounded and written."""
    rows, k = x_ref.shape
    starts = range(0, k, chunk)
    values = [x_ref[:, k0:k0 + chunk].astype(jnp.float32) for k0 in starts]
    amax = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(v), axis=1) for v in values])
    scale, inverse = _pow2_scale_and_inverse(amax, dtype)
    for k0, v in zip(starts, values):
        q_ref[:, k0:k0 + chunk] = jnp.clip(v * inverse[:, None], -fmax, fmax).astype(dtype)
    s_ref[...] = scale[:, None]


def _largest_power_of_two_dividing(n: int, limit: int) -> int:
    p = 1
    while p * 2 <= limit and n % (p * 2) == 0:
        p *= 2
    return p


def quantize_rows(a: jax.Array, fmt: str = "e4m3", *,
                  max_chunk: int = 2048, max_elements: int = 16384, num_warps: int = 8,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(aq [..., K] float8, scale [..., 1] float32) = `quantize_rows_reference(a, fmt)`, bit for bit.

    K must be a multiple of 16. A program takes whole rows, as many as
    fit `max_elements` (a power of two dividing the row count, at least one), loaded in chunks of a power of two
    dividing K."""
    dtype = fp8_dtype(fmt)
    lead, k = a.shape[:-1], a.shape[-1]
    if k % 16:
        raise ValueError(f"quantize_rows needs the last axis a multiple of 16, got {k}")
    a2 = a.reshape(-1, k)
    m = a2.shape[0]
    per_call = addressable_rows(m, (k,), dtype)
    if per_call < m:  # an output of 2^31+ bytes: rows in calls the kernel addresses correctly
        parts = [quantize_rows(a2[i:i + per_call], fmt, max_chunk=max_chunk, max_elements=max_elements,
                               num_warps=num_warps, interpret=interpret) for i in range(0, m, per_call)]
        q = jnp.concatenate([p[0] for p in parts])
        return q.reshape(a.shape), jnp.concatenate([p[1] for p in parts]).reshape(*lead, 1)
    chunk = _largest_power_of_two_dividing(k, max_chunk)
    rows = _largest_power_of_two_dividing(m, max(1, max_elements // k))
    q, scale = pl.pallas_call(
        functools.partial(_kernel, chunk=chunk, fmax=float(jnp.finfo(dtype).max), dtype=dtype),
        grid=(m // rows,),
        in_specs=[pl.BlockSpec((rows, k), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((rows, k), lambda i: (i, 0)), pl.BlockSpec((rows, 1), lambda i: (i, 0))),
        out_shape=(jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((m, 1), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="fp8_quantize_rows",
    )(a2)
    return q.reshape(a.shape), scale.reshape(*lead, 1)
