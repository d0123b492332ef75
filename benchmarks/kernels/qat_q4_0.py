"""Quantization-aware training's q4_0 weight on Llama-3-8B weight shapes: the one-pass Pallas kernel
(pallas_kernels/qat_q4_0.py) against XLA's passes (its jnp reference, what the step ran before) and against the
plain step's per-weight pass (NF4 dequantized to bf16), with the kernel's agreement with the reference on the GPU.

    PYTHONPATH=. python3 benchmarks/kernels/qat_q4_0.py
One JSON line per shape: µs per call of each, and the fraction of weights where kernel and reference differ (a
rounding edge: the reference's float32 merge is XLA's dot, the kernel's an in-register one) with the largest
difference in units of the block's code step.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.nf4_matmul import SHAPES, repeated, time_us
from pallas_kernels.nf4_dequant import nf4_dequantize
from pallas_kernels.qat_q4_0 import qat_q4_0_reference, qat_q4_0_weight

RANK, SCALE = 16, 1.0


def main() -> None:
    rng = np.random.default_rng(0)
    kind = jax.local_devices()[0].device_kind
    for name, (n, k) in SHAPES.items():
        codes = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)
        absmax = jnp.asarray(rng.uniform(0.005, 0.05, (n, k // 64)), jnp.float32)
        a = jnp.asarray(rng.normal(size=(RANK, k)) * 0.02, jnp.float32)
        b = jnp.asarray(rng.normal(size=(n, RANK)) * 0.02, jnp.float32)
        kernel = jax.jit(lambda a, b, c, s: qat_q4_0_weight(a, b, c, s, scale=SCALE))
        reference = jax.jit(lambda a, b, c, s: qat_q4_0_reference(c, s, a, b, SCALE))
        got, want = np.asarray(kernel(a, b, codes, absmax), np.float32), np.asarray(reference(a, b, codes, absmax),
                                                                                   np.float32)
        blocks = np.abs(want.reshape(n, -1, 32)).max(-1, keepdims=True) / 7  # >= a block's code step
        step = np.broadcast_to(blocks, (n, k // 32, 32)).reshape(n, k)
        differ = got != want
        line = {
            "device": kind, "shape": name, "N": n, "K": k, "rank": RANK,
            "kernel_us": round(time_us(jax.jit(repeated(lambda a, b, c, s: qat_q4_0_weight(a, b, c, s, scale=SCALE))),
                                       a, b, codes, absmax), 1),
            "xla_us": round(time_us(jax.jit(repeated(lambda a, b, c, s: qat_q4_0_reference(c, s, a, b, SCALE))),
                                    a, b, codes, absmax), 1),
            "plain_dequant_us": round(time_us(jax.jit(repeated(lambda s, c: nf4_dequantize(c, s))), absmax, codes), 1),
            "differ_fraction": float(differ.mean()),
            "max_diff_in_steps": float((np.abs(got - want) / step)[differ].max()) if differ.any() else 0.0,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
