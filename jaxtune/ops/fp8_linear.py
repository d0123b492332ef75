"""A frozen NF4 projection as FP8 GEMMs (Ada/Hopper): e4m3 operands with power-of-two scales per token row and
per weight row (per input block of Wᵀ for the input gradient), through cuBLASLt, the Pallas FP8 kernel, or the
jnp reference on CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtune.ops.context import barrier, fp8_inputs_seen
from jaxtune.ops.kernel_operands import dequantized, fp8_scales
from jaxtune.ops.dense import zero_cotangent
from jaxtune.ops.nf4_linear import bf16_nf4_matmul
from jaxtune.ops.sharded import per_batch_shard, per_batch_shard_with
from jaxtune.quant.nf4 import dequantize

# output gradients in FP8: e4m3 (3 mantissa bits) measured more accurate than e5m2 (benchmarks/kernels/fp8_matmul.py);
# power-of-two scales per row give e4m3 the range gradients need
FP8_GRAD_FORMAT = "e4m3"


def fp8_weight(weight, kernel: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(wq e4m3 [out, in], scale float32 [out]): W ≈ wq * scale per output row, the scale the power of two
    that brings the row's largest |w| (its largest NF4 absmax) to e4m3's range. One rounding of bnb's
    float32 value NF4[code] * absmax; on GPU by the Pallas NF4 dequant kernel writing e4m3 directly."""
    from pallas_kernels.fp8_quantize import E4M3

    scale = fp8_scales(weight, "rows")
    if kernel:
        return dequantized(weight, E4M3, interpret, fp8_kind="rows", permute=True), scale
    return (dequantize(weight, jnp.float32) / scale[:, None]).astype(E4M3), scale


def fp8_weight_t(weight, kernel: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(wtq e4m3 [in, out], scale float32 [in]): Wᵀ ≈ wtq * scale per row of Wᵀ (K-major for the input
    gradient's GEMM, written so by the kernel), the scale constant over each 64-block of W's input columns: the
    power of two that brings the block's largest absmax down all rows to e4m3's range. The scale then multiplies
    the GEMM's output columns, so the output gradient is quantized as it is (no factor along the contraction).
    The values are those of the forward's `fp8_weight` (powers of two commute with the rounding) wherever
    both land in e4m3's normal range, i.e. for rows whose absmax is within ~2^10 of the block's largest."""
    from pallas_kernels.fp8_quantize import E4M3

    blocks = fp8_scales(weight, "blocks")
    scale = jnp.broadcast_to(blocks[:, None], (blocks.shape[0], 64)).reshape(-1)
    if kernel:
        return dequantized(weight, E4M3, interpret, transpose=True, fp8_kind="blocks", permute=True), scale
    return (dequantize(weight, jnp.float32) / scale[None, :]).astype(E4M3).T, scale


def _fp8_gemm(aq, a_scale, bq, b_scale, out_dtype, impl: str, interpret: bool):
    """dequant(aq) [..., K] @ dequant(bq)ᵀ for K-major bq [out, K]; one scale per row of aq ([..., 1]) and
    per output column (b_scale [out])."""
    from pallas_kernels import fp8_matmul as fp8

    if impl == "pallas":
        gemm = lambda a, s, b, t: fp8.fp8_matmul(a, s, b, t[:, None], out_dtype=out_dtype, interpret=interpret)  # noqa: E731
        return per_batch_shard_with(gemm, (aq, a_scale), (bq, b_scale))
    if impl == "cublas":  # cuBLASLt's FP8 GEMM; the power-of-two scales then multiply exactly (XLA fuses them)
        y = jax.lax.dot_general(aq, bq, (((aq.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
        return (y.astype(jnp.float32) * a_scale * b_scale).astype(out_dtype)
    return fp8.fp8_matmul_reference(aq, a_scale, bq, b_scale[:, None], out_dtype)


def _quantize_rows(a, fmt: str, impl: str, interpret: bool):
    """(aq, scale [..., 1]): a in FP8 with a power-of-two scale per row. Off the XLA reference path, one Pallas
    pass per tensor (pallas_kernels/fp8_quantize.py) instead of XLA's row reduction fused into a's producer plus a
    separate cast pass; the same bits either way."""
    from pallas_kernels import fp8_quantize

    if impl == "xla":
        return fp8_quantize.quantize_rows_reference(a, fmt)
    return per_batch_shard(lambda a: fp8_quantize.quantize_rows(a, fmt=fmt, interpret=interpret), a)


def fp8_input(x: jax.Array, impl: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """x's e4m3 rows and scales, quantized once per traced array in the current "fp8" block (gate and up share
    their input; XLA was seen to keep both quantizer kernels inside the layer scan)."""
    seen = fp8_inputs_seen()
    for a, quantized in seen or ():
        if a is x:
            return quantized
    quantized = _quantize_rows(jax.lax.stop_gradient(x), "e4m3", impl, interpret)
    if seen is not None:
        seen.append((x, quantized))
    return quantized


def _input_gradient(weight, dy: jax.Array, impl: str, interpret: bool) -> jax.Array:
    """dx = dy @ W = (dy quantized per row) @ (Wᵀ quantized per input block)ᵀ: both scales sit outside the
    contraction, so they multiply dx's rows and columns after the GEMM."""
    wtq, wt_scale = fp8_weight_t(weight, impl != "xla", interpret)
    gq, g_scale = _quantize_rows(dy, FP8_GRAD_FORMAT, impl, interpret)
    return _fp8_gemm(gq, g_scale, wtq, wt_scale, dy.dtype, impl, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def fp8_nf4_matmul(x, xq, x_scale, weight, impl: str, interpret: bool, at_use: bool = False):
    """y = x @ dequant(W)ᵀ from x's FP8 rows (xq, x_scale: `fp8_input(x)`); x is there for its gradient.
    `at_use`: dequantize at use (`context.dequantize_at_use`)."""
    xq, weight = barrier(at_use, xq, weight)
    wq, w_scale = fp8_weight(weight, impl != "xla", interpret)
    return _fp8_gemm(xq, x_scale, wq, w_scale, x.dtype, impl, interpret)


def _fp8_nf4_matmul_fwd(x, xq, x_scale, weight, impl, interpret, at_use):
    # like the bf16 path: only the 4-bit arrays are kept; the FP8 weight is re-derived in the backward pass
    return fp8_nf4_matmul(x, xq, x_scale, weight, impl, interpret, at_use), weight


def _fp8_nf4_matmul_bwd(impl, interpret, at_use, weight, dy):
    from pallas_kernels.fp8_quantize import E4M3

    weight, dy = barrier(at_use, weight, dy)
    dx = _input_gradient(weight, dy, impl, interpret)
    # xq and its scales come from x through stop_gradient: their cotangents are dropped
    lead = dy.shape[:-1]
    return (dx, jnp.zeros((*lead, dx.shape[-1]), E4M3), jnp.zeros((*lead, 1), jnp.float32),
            jax.tree.map(zero_cotangent, weight))


fp8_nf4_matmul.defvjp(_fp8_nf4_matmul_fwd, _fp8_nf4_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def fp8_dx_nf4_matmul(x, weight, impl: str, fp8: str, interpret: bool, at_use: bool = False):
    """y = x @ dequant(W)ᵀ in x's dtype (`impl`: the bf16 path's), its input gradient an FP8 GEMM (`fp8`: that
    GEMM's implementation)."""
    return bf16_nf4_matmul(x, weight, impl, interpret, at_use)


def _fp8_dx_nf4_matmul_fwd(x, weight, impl, fp8, interpret, at_use):
    return fp8_dx_nf4_matmul(x, weight, impl, fp8, interpret, at_use), weight


def _fp8_dx_nf4_matmul_bwd(impl, fp8, interpret, at_use, weight, dy):
    weight, dy = barrier(at_use, weight, dy)
    return _input_gradient(weight, dy, fp8, interpret), jax.tree.map(zero_cotangent, weight)


fp8_dx_nf4_matmul.defvjp(_fp8_dx_nf4_matmul_fwd, _fp8_dx_nf4_matmul_bwd)
