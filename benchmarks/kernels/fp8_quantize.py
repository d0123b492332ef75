"""Row-wise FP8 quantization on the 8B step's shapes: the one-pass Pallas kernel against XLA's version.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/kernels/fp8_quantize.py [--tokens 2048,8192]
Per [tokens, K] bf16 operand (K = 1024 v's output gradient, 4096 the hidden size, 14336 the MLP width) it
prints one JSON line: µs per call of XLA's quantizer (`quantize_rows_reference`: a row reduction, then the cast),
of the kernel in each launch configuration, the kernel's HBM traffic rate (one bf16 read, one e4m3 write), and
whether the kernel's bytes equal XLA's.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8_quantize import quantize_rows, quantize_rows_reference

CONFIGS = [  # (max_chunk, max_elements, num_warps)
    (2048, 16384, 8), (2048, 16384, 4), (2048, 16384, 16), (1024, 16384, 8), (2048, 32768, 8), (2048, 32768, 16),
]


def time_us(op, *args, calls: int = 40, iters: int = 3) -> float:
    """µs per call of the jitted op over `calls` back-to-back dispatches (the GPU queue stays full: the calls
    are independent and each takes longer than its dispatch), best of `iters`."""
    fn = jax.jit(op)
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        jax.block_until_ready(outs)
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8192")
    args = ap.parse_args()
    for m in (int(t) for t in args.tokens.split(",")):
        for k in (1024, 4096, 14336):
            rng = np.random.default_rng(k)
            a = jnp.asarray(rng.standard_normal((m, k)) * np.exp(rng.uniform(-3, 3, (m, 1))), jnp.bfloat16)
            row = {"tokens": m, "k": k, "xla_us": round(time_us(quantize_rows_reference, a), 1)}
            q_ref, s_ref = jax.jit(quantize_rows_reference)(a)
            for chunk, elements, warps in CONFIGS:
                def op(a, chunk=chunk, elements=elements, warps=warps):
                    return quantize_rows(a, max_chunk=chunk, max_elements=elements, num_warps=warps)

                name = f"kernel_c{chunk}e{elements}w{warps}"
                row[name + "_us"] = round(time_us(op, a), 1)
                q, s = jax.jit(op)(a)
                same_bytes = np.array_equal(np.asarray(q).view(np.uint8), np.asarray(q_ref).view(np.uint8))
                row[name + "_equal"] = bool(same_bytes and np.array_equal(np.asarray(s), np.asarray(s_ref)))
            best = min(v for key, v in row.items() if key.startswith("kernel") and key.endswith("_us"))
            row["kernel_best_gb_s"] = round(m * k * 3 / best / 1e3, 1)
            print(json.dumps(row), flush=True)

if __name__ == "__main__":
    main()
