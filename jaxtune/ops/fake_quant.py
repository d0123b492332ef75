"""Quantization-aware training's rounded weight from a frozen NF4 projection in one Pallas pass, where the kernel
serves the format (q4_0: `pallas_kernels/qat_q4_0.py`) and `dispatch.qat_impl` picks it. Elsewhere the caller
rounds in XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.ops import dispatch
from jaxtune.ops.kernel_operands import kernel_shaped, with_codes
from jaxtune.parallel.sharding import current_mesh


def fused_round_trip(weight, a: jax.Array, b: jax.Array, scale: float, fmt: str, dtype) -> jax.Array | None:
    """`fmt`'s read-back of NF4 W + scale * B @ A [out, in] in dtype by one kernel pass over the codes, or None
    where the kernel does not run (another format, `dispatch.qat_impl`, a mesh, tiles that do not divide W)."""
    if fmt != "q4_0" or dispatch.qat_impl() != "pallas" or current_mesh() is not None or not kernel_shaped(weight):
        return None
    from pallas_kernels.qat_q4_0 import qat_q4_0_weight

    def kernel(codes, absmax, **layer):
        return qat_q4_0_weight(a, b, codes, absmax, scale=scale, dtype=jnp.dtype(dtype),
                               interpret=dispatch.interpret(), **layer)

    return with_codes(weight, kernel)
