"""One decoding step's attention: the Pallas decode kernel (reads the filled blocks only) against XLA's attention
over the whole cache (jaxtune.ops.attention's reference path), at a rollout's shapes and fill levels.

    PYTHONPATH=. python3 benchmarks/kernels/decode_attention.py
One JSON line per case: milliseconds of each, the cache bytes the kernel must read, and its rate in GB/s.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxtune.ops.attention import attention
from pallas_kernels.decode_attention import decode_attention

# (rows, query heads, KV heads, cache length, head size, window, filled entries)
CASES = [(64, 32, 8, 768, 128, None, 384), (64, 32, 8, 768, 128, None, 767), (16, 32, 8, 768, 128, None, 512),
         (64, 64, 8, 768, 64, 128, 600), (16, 32, 16, 4096, 256, 1024, 3000), (16, 32, 4, 4096, 512, None, 3000)]


def timed(fn, *args, reps: int = 50) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    interpret = jax.default_backend() != "gpu"
    key = jax.random.key(0)
    for b, hq, hkv, s, d, window, filled in CASES:
        if interpret:  # a CPU check of this script: small shapes
            b, s, filled = 2, 64, 40
        q = jax.random.normal(key, (b, 1, hq, d), jnp.bfloat16)
        k = jax.random.normal(key, (b, s, hkv, d), jnp.bfloat16)
        v = jax.random.normal(key, (b, s, hkv, d), jnp.bfloat16)
        seg = (jnp.arange(s)[None] <= filled).astype(jnp.int32) * jnp.ones((b, 1), jnp.int32)
        qseg = jnp.ones((b, 1), jnp.int32)
        index = jnp.int32(filled)
        xla = jax.jit(lambda q, k, v, qs, ks, i: attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks, q_offset=i,
                                                           sliding_window=window))
        kernel = jax.jit(lambda q, k, v, qs, ks, i: decode_attention(q[:, 0], k, v, qs[:, 0], ks, i, window=window,
                                                                     interpret=interpret))
        args = (q, k, v, qseg, seg, index)
        want, got = xla(*args), kernel(*args)
        err = float(jnp.max(jnp.abs(want[:, 0].astype(jnp.float32) - got.astype(jnp.float32))))
        read = filled + 1 if window is None else min(filled + 1, window + 64)
        kv_bytes = 2 * b * read * hkv * d * 2
        x_ms, k_ms = timed(xla, *args), timed(kernel, *args)
        print(json.dumps({"device": jax.devices()[0].device_kind, "rows": b, "q_heads": hq, "kv_heads": hkv,
                          "cache": s, "head_dim": d, "window": window, "filled": filled, "xla_ms": round(x_ms, 4),
                          "kernel_ms": round(k_ms, 4), "kernel_vs_xla": round(x_ms / k_ms, 2),
                          "kernel_gb_per_s": round(kv_bytes / k_ms / 1e6, 1),
                          "xla_gb_per_s_whole_cache": round(2 * b * s * hkv * d * 2 / x_ms / 1e6, 1),
                          "max_abs_diff": err}), flush=True)


if __name__ == "__main__":
    main()
