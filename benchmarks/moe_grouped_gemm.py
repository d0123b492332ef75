"""The experts' grouped GEMM (`jaxtune.moe.grouped_matmul`, jax.lax.ragged_dot) against one cuBLAS GEMM of the
same FLOPs, on a mixture of experts' training shapes, and the NF4 dequantization of a layer's experts.

    PYTHONPATH=. python3 benchmarks/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 8192
Prints one JSON line per projection: milliseconds and TFLOP/s of the grouped GEMM (forward; forward + input
gradient, as QLoRA's frozen experts need) and of the dense GEMM, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune import nf4
from jaxtune.moe.grouped import grouped_matmul

SHAPES = {  # hidden, expert width, experts, experts per token
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def timed(fn, *args, reps: int = 20) -> float:
    """Median milliseconds of one call (compiled, warmed up)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    hidden, width, experts, top_k = SHAPES[args.model]
    rows = args.tokens * top_k
    rng = np.random.default_rng(0)
    # a router's choice over random tokens: near-uniform groups (what a trained router's balancing loss aims at)
    sizes = jnp.asarray(np.bincount(rng.integers(0, experts, rows), minlength=experts), jnp.int32)
    key = jax.random.key(0)
    for name, (k, n) in {"gate_up": (hidden, width), "down": (width, hidden)}.items():
        x = jax.random.normal(key, (rows, k), jnp.bfloat16)
        w = (0.02 * jax.random.normal(key, (experts, n, k), jnp.float32)).astype(jnp.bfloat16)
        dense_w = w[0]
        flops = 2.0 * rows * k * n
        grouped = jax.jit(lambda x, w: grouped_matmul(x, w, sizes))
        dense = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        dy = jax.random.normal(key, (rows, n), jnp.bfloat16)
        grouped_dx = jax.jit(lambda x, w, dy: jax.vjp(lambda x: grouped_matmul(x, w, sizes), x)[1](dy)[0])
        dense_dx = jax.jit(lambda x, w, dy: jax.vjp(lambda x: jnp.dot(x, w.T).astype(jnp.bfloat16), x)[1](dy)[0])
        g, d = timed(grouped, x, w), timed(dense, x, dense_w)
        gdx, ddx = timed(grouped_dx, x, w, dy), timed(dense_dx, x, dense_w, dy)
        q = jax.jit(jax.vmap(nf4.quantize_traced))(w)
        dequant = timed(jax.jit(lambda q: nf4.dequantize(q, jnp.bfloat16)), q)
        print(json.dumps({
            "model": args.model, "projection": name, "rows": rows, "k": k, "n": n, "experts": experts,
            "device": jax.devices()[0].device_kind,
            "grouped_ms": round(g, 3), "dense_ms": round(d, 3), "grouped_tflops": round(flops / g / 1e9, 1),
            "dense_tflops": round(flops / d / 1e9, 1), "grouped_vs_dense": round(d / g, 3),
            "grouped_dx_ms": round(gdx, 3), "dense_dx_ms": round(ddx, 3), "dx_grouped_vs_dense": round(ddx / gdx, 3),
            "nf4_dequant_all_experts_ms": round(dequant, 3),
        }), flush=True)


if __name__ == "__main__":
    main()
