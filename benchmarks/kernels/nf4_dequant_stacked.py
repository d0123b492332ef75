"""NF4 dequantization of one layer of a stack of codes, Qwen3-32B's MLP shapes: the codes read as bytes in place, as
uint16 pairs (planes interleaved in registers, or by strided stores), and the layer copied out first (what the kernels did
for a stack past 32-bit byte offsets before pairs). Then the whole 64-layer stack (3.9 GiB, past those offsets):
its last layers through the default path, against the jnp reference on the layer's own codes.

    PYTHONPATH=. python3 benchmarks/kernels/nf4_dequant_stacked.py
One JSON line per (shape, variant): microseconds per call, GB/s of codes + absmax read and bf16 written.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.nf4_matmul import repeated, time_us
from pallas_kernels.nf4_dequant import nf4_dequantize, nf4_dequantize_reference

SHAPES = {"qwen3-32b gate/up": (25600, 5120), "qwen3-32b down": (5120, 25600)}
LAYER = 5


def variants(layer: jax.Array) -> dict:
    """name: fn(absmax, codes stack)."""
    def call(**kw):
        return lambda a, c: nf4_dequantize(c, a, layer=layer, **kw)

    def copied(a, c):
        return nf4_dequantize(jax.lax.dynamic_index_in_dim(c, layer, keepdims=False), a)

    return {"bytes in place": call(), "layer copied, then bytes": copied,
            "pairs: planes interleaved": call(pairs=True),
            "pairs: planes, 4 strided stores": call(pairs=True, interleave=False)}


def main() -> None:
    print(json.dumps({"device": jax.local_devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    rng = np.random.default_rng(0)
    layer = jnp.int32(LAYER)
    for name, (n, k) in SHAPES.items():
        stack = jnp.asarray(rng.integers(0, 256, (8, n, k // 2), dtype=np.uint8))
        absmax = jnp.asarray(rng.uniform(0.01, 1.0, (n, k // 64)).astype(np.float32))
        want = nf4_dequantize_reference(stack[LAYER], absmax)
        moved = n * k // 2 + n * k // 64 * 4 + 2 * n * k
        for variant, fn in variants(layer).items():
            exact = bool(jnp.array_equal(jax.jit(fn)(absmax, stack), want))
            us = time_us(repeated(fn), absmax, stack)
            print(json.dumps({"shape": name, "variant": variant, "us": round(us, 1), "gbps": round(moved / us / 1e3),
                              "exact": exact}), flush=True)
        del stack
    n, k = SHAPES["qwen3-32b gate/up"]
    stack = jax.jit(lambda key: jax.random.randint(key, (64, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8))(
        jax.random.key(0))
    absmax = jnp.asarray(rng.uniform(0.01, 1.0, (n, k // 64)).astype(np.float32))
    for last in (33, 63):
        got = jax.jit(lambda c, a, i: nf4_dequantize(c, a, layer=i))(stack, absmax, jnp.int32(last))
        exact = bool(jnp.array_equal(got, nf4_dequantize_reference(stack[last], absmax)))
        print(json.dumps({"shape": "qwen3-32b gate/up, 64-layer stack", "layer": last, "exact": exact}), flush=True)


if __name__ == "__main__":
    main()
