"""The one dispatch point for the model's heavy ops (projections and attention).

Every matmul and attention call of the model goes through here, so faster backends (Pallas kernels, cuDNN,
FP8 GEMMs) plug in without touching the model. Each concern lives in its own module: `attention`, `dense`
(XLA matmuls), `nf4_linear` (frozen NF4 projections in bf16), `fp8_linear` (the same as FP8 GEMMs),
`kernel_operands` (what the Pallas kernels read of a weight), `sharded` (kernels per shard on a mesh),
`context` (the trace-time layer index, compute mode and shared-prefix segments) and `dispatch` (which implementation runs, from
measured tables; `JAXTUNE_KERNELS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.ops import dispatch
from jaxtune.ops.attention import attention, attention_mask
from jaxtune.ops.context import (COMPUTE_MODES, barrier, fake_quantize_format, fake_quantized, frozen_compute,
                                 frozen_compute_mode, segments_share_prefixes, dequantize_at_use, dequantizing_at_use,
                                 shared_prefix_segments, stacked_layer, stacked_layer_index, static_layer,
                                 static_layer_index)
from jaxtune.ops.dense import dot_out, linear, rows
from jaxtune.ops.fp8_linear import FP8_GRAD_FORMAT, fp8_dx_nf4_matmul, fp8_input, fp8_nf4_matmul
from jaxtune.ops.kernel_operands import kernel_shaped, kernels_read_prepared_scales, prepare_kernel_scales
from jaxtune.ops.nf4_linear import bf16_nf4_matmul, dense_nf4_weight


def nf4_linear(x: jax.Array, weight, bias: jax.Array | None = None) -> jax.Array:
    """y = x @ dequant(W).T (+ bias) for a frozen NF4 weight [out, in].

    In the mode `frozen_compute` set: "bf16" (`nf4_linear.bf16_nf4_matmul`: XLA, or on GPU the fused Pallas
    kernel or the Pallas dequant + cuBLAS, per `dispatch`), "fp8" (forward and input gradient as FP8 GEMMs,
    `fp8_linear`) or "fp8-dx" (only the input gradient in FP8). Weights the kernels' tiles do not divide stay
    on the bf16 path.
    """
    impl, mode, interpret = dispatch.nf4_impl(rows(x)), frozen_compute_mode(), dispatch.interpret()
    at_use = dequantizing_at_use()
    fp8 = dispatch.fp8_impl() if mode != "bf16" and kernel_shaped(weight) else None
    if fp8 and mode == "fp8":
        y = fp8_nf4_matmul(x, *fp8_input(x, fp8, interpret), weight, fp8, interpret, at_use)
    elif fp8:  # "fp8-dx"
        y = fp8_dx_nf4_matmul(x, weight, impl, fp8, interpret, at_use)
    else:
        y = bf16_nf4_matmul(x, weight, impl, interpret, at_use)
    return y if bias is None else (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


__all__ = [
    "COMPUTE_MODES",
    "FP8_GRAD_FORMAT",
    "attention",
    "attention_mask",
    "barrier",
    "dense_nf4_weight",
    "dequantize_at_use",
    "dispatch",
    "dot_out",
    "fake_quantize_format",
    "fake_quantized",
    "frozen_compute",
    "frozen_compute_mode",
    "kernels_read_prepared_scales",
    "linear",
    "nf4_linear",
    "prepare_kernel_scales",
    "stacked_layer",
    "stacked_layer_index",
    "static_layer",
    "static_layer_index",
]
