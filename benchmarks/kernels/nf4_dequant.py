"""NF4 dequantization kernel (Pallas) on Llama-3-8B weight shapes: tile sweep, GB/s against the copy roofline.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/kernels/nf4_dequant.py [--dtype e4m3] [--transpose]
Traffic per call: the 4-bit codes and float32 absmax read, the bf16 (or e4m3: the FP8 path's operand, W or Wᵀ)
weight written; the yardstick is the HBM bandwidth of the data sheet (H200 4.8 TB/s, H100 3.35 TB/s), which no
pass reaches in full.
Prints one JSON line per (shape, variant) and a markdown table.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.nf4_matmul import SHAPES, time_us, repeated
from pallas_kernels.nf4_dequant import nf4_dequantize, nf4_dequantize_reference

PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0}  # HBM bandwidth on the data sheet

VARIANTS = {  # name: nf4_dequantize keyword arguments
    "n64b64w4-strided": dict(block_n=64, block_bytes=64, num_warps=4),
    "n64b64w4-interleave": dict(block_n=64, block_bytes=64, num_warps=4, interleave=True),
    "n256b64w8-interleave": dict(block_n=256, block_bytes=64, num_warps=8, interleave=True),
    "n128b64w4-interleave": dict(block_n=128, block_bytes=64, num_warps=4, interleave=True),
    "n256b64w4-interleave": dict(block_n=256, block_bytes=64, num_warps=4, interleave=True),
    "n128b64w8-interleave": dict(block_n=128, block_bytes=64, num_warps=8, interleave=True),
    "n128b64w4-strided": dict(block_n=128, block_bytes=64, num_warps=4),
    "n128b64w4-interleave-select": dict(block_n=128, block_bytes=64, num_warps=4, interleave=True, lut="select"),
    "n512b64w8-interleave": dict(block_n=512, block_bytes=64, num_warps=8, interleave=True),
    "n128b64w8-interleave-select": dict(block_n=128, block_bytes=64, num_warps=8, interleave=True, lut="select"),
    "n64b64w4-interleave-select": dict(block_n=64, block_bytes=64, num_warps=4, interleave=True, lut="select"),
    "n256b64w8-interleave-select": dict(block_n=256, block_bytes=64, num_warps=8, interleave=True, lut="select"),
    "n64b64w2-interleave": dict(block_n=64, block_bytes=64, num_warps=2, interleave=True),
    "n32b64w4-interleave": dict(block_n=32, block_bytes=64, num_warps=4, interleave=True),
}
# names without "-cols": launched down columns of tiles (the kernel's default before 2026-11-24); "-cols": the same
# tiles launched along rows of codes first (`columns_first`, the default now with n64b64w4)
VARIANTS = {k: dict(v, columns_first=False) for k, v in VARIANTS.items()} | {
    f"{k}-cols": dict(VARIANTS[k], columns_first=True) for k in (
        "n128b64w8-interleave", "n64b64w4-interleave", "n256b64w8-interleave", "n128b64w4-interleave",
        "n64b64w2-interleave", "n32b64w4-interleave")}
# e4m3 only: each (row, block)'s 16 values rounded once into a byte table, code bytes turned into output bytes by
# byte permutes (the FP8 path's default since 2026-11-24)
E4M3_VARIANTS = {"n64b64w4-permute": dict(block_n=64, block_bytes=64, num_warps=4, permute=True),
                 "n64b64w8-permute": dict(block_n=64, block_bytes=64, num_warps=8, permute=True)}
DTYPES = {"bf16": jnp.bfloat16, "e4m3": jnp.float8_e4m3fn}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--transpose", action="store_true", help="write Wᵀ [K, N] (the FP8 input gradient's operand)")
    ap.add_argument("--variants", help="comma-separated subset of the variant names")
    args = ap.parse_args()
    dtype, transpose = DTYPES[args.dtype], args.transpose
    candidates = VARIANTS | (E4M3_VARIANTS if args.dtype == "e4m3" else {})
    variants = {k: v for k, v in candidates.items() if not args.variants or k in args.variants.split(",")}
    print(json.dumps({"device": jax.local_devices()[0].device_kind, "jax": jax.__version__, "dtype": args.dtype,
                      "transpose": transpose}), flush=True)
    rng = np.random.default_rng(0)
    kind = jax.local_devices()[0].device_kind
    peak_gbps = next((v for k, v in PEAK_GBPS.items() if k in kind), float("nan"))
    rows = []
    for shape_name, (n, k) in SHAPES.items():
        codes = jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
        absmax = jnp.asarray(rng.uniform(0.01, 1.0, (n, k // 64)).astype(np.float32))
        ref = jax.jit(lambda c, a: nf4_dequantize_reference(c, a, dtype))(codes, absmax)
        w = (ref.T if transpose else ref).astype(jnp.float32)
        moved = n * k // 2 + n * k // 64 * 4 + jnp.dtype(dtype).itemsize * n * k
        for name, kw in variants.items():
            kw = dict(kw, transpose=transpose)
            row = {"shape": shape_name, "N": n, "K": k, "variant": name}
            try:
                got = jax.jit(lambda c, a, kw=kw: nf4_dequantize(c, a, dtype, **kw))(codes, absmax)
                row["exact"] = bool(jnp.array_equal(got.astype(jnp.float32), w))
                # the op's first operand carries the loop dependency: pass absmax first
                row["us"] = time_us(repeated(lambda a, c, kw=kw: nf4_dequantize(c, a, dtype, **kw)), absmax, codes)
                row["gbps"] = moved / row["us"] / 1e3
                row["vs_peak"] = row["gbps"] / peak_gbps
            except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| shape | variant | us | GB/s | of HBM peak | exact |\n|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['variant']} | {r['error']} | | | |")
        else:
            print(f"| {r['shape']} | {r['variant']} | {r['us']:.1f} | {r['gbps']:.0f} | {r['vs_peak']:.2f} | "
                  f"{r.get('exact', '')} |")


if __name__ == "__main__":
    main()
