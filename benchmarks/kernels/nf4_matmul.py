"""NF4 matmul on Llama-3-8B projection shapes: fused Pallas kernel vs dequant+dot vs bf16 jnp.dot.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/kernels/nf4_matmul.py [--ms 1,16,128,2048,8192,16384] [--out table.json]
For every (projection shape, M, direction) it times: `bf16` (jnp.dot on a bf16 W, the yardstick),
`xla` (jnp dequantize then dot, one jit), `dequant+dot` (the Pallas dequant kernel, then jnp.dot) and
the fused kernel over a few tile configurations. Direction `fwd` is y = x Wᵀ, `dx` is dy W. Each op is
repeated inside one jit (a fori_loop whose input depends on the carry), so launch overhead is not
measured. Prints JSON lines, a markdown table, and writes the dispatch table (fastest per case).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.nf4_dequant import nf4_dequantize, nf4_dequantize_reference
from pallas_kernels.nf4_matmul import MatmulTiles, nf4_matmul_dx, nf4_matmul_forward

SHAPES = {  # name: (N, K) of W [N, K]
    "q_proj/o_proj": (4096, 4096),
    "k_proj/v_proj": (1024, 4096),
    "gate_proj/up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}
REPEAT = 20


def candidates(m: int, direction: str) -> list[MatmulTiles]:
    if m <= 16:
        tensor_core = [MatmulTiles(16, 64, 32, 8, 4, 3), MatmulTiles(16, 32, 64, 8, 2, 3),
                       MatmulTiles(16, 64, 64, 4, 4, 3), MatmulTiles(16, 64, 32, 16, 4, 3),
                       MatmulTiles(16, 128, 32, 8, 4, 2), MatmulTiles(16, 64, 32, 8, 4, 3, lut="select")]
        # decoding's few rows on the CUDA cores (forward only): rows x block_n x bytes products per step
        gemv = [MatmulTiles(min(m, 4), bn, bb, split, warps, 3, lut=lut, gemv=True)
                for bn, bb, split, warps, lut in ((32, 64, 4, 4, "gather"), (64, 32, 4, 4, "gather"),
                                                  (16, 64, 8, 2, "gather"), (64, 64, 2, 4, "gather"),
                                                  (32, 32, 8, 2, "gather"), (32, 64, 4, 4, "select"),
                                                  (128, 32, 2, 8, "gather"), (64, 64, 4, 4, "gather"),
                                                  (128, 64, 4, 4, "gather"), (128, 64, 8, 8, "gather"),
                                                  (64, 64, 8, 4, "gather"), (32, 64, 8, 2, "gather"),
                                                  (256, 64, 4, 8, "gather"), (128, 32, 8, 4, "gather"),
                                                  (64, 64, 16, 4, "gather"), (16, 64, 16, 2, "gather"),
                                                  (64, 64, 8, 4, "select"), (128, 64, 8, 4, "gather"))]
        weight_first = [MatmulTiles(16, bn, bb, split, 4, 3, lut=lut, weight_first=True)
                        for bn in (64, 128) for bb in (32, 64) for split in (4, 8) for lut in ("select", "permute")]
        return (tensor_core + (gemv if direction == "fwd" and m <= 4 else [])
                + (weight_first if direction == "fwd" and m > 4 else []))
    if m <= 64 and direction == "fwd":  # a GRPO rollout's decode rows: one tile of rows reads each code once
        # the weight tile as the dot's left operand (wgmma's register operand), and the best x-first tile of
        # 2026-11-27 (benchmarks/results/2026-11-27-grpo-h100.md) to compare
        return [MatmulTiles(64, 32, 32, 2, 4, 3, lut="gather")] + [
            MatmulTiles(64, bn, bb, split, warps, 3, lut=lut, weight_first=True)
            for bn in (64, 128) for bb in (32, 64) for split in (1, 2, 4) for lut in ("select", "permute")
            for warps in ((4, 8) if bn == 128 else (4,))] + [
            MatmulTiles(64, bn, bb, split, 4, 3, lut="permute") for bn in (32, 64) for bb in (32, 64) for split in (2, 4)]
    if m <= 256:
        return [MatmulTiles(64, 64, 64, 2, 4, 3), MatmulTiles(128, 128, 64, 1, 8, 3), MatmulTiles(64, 128, 32, 2, 4, 3),
                MatmulTiles(32, 64, 64, 4, 4, 3)]
    return [MatmulTiles(256, 128, 64, 1, 8, 3), MatmulTiles(128, 128, 64, 1, 8, 3), MatmulTiles(128, 256, 64, 1, 8, 3),
            MatmulTiles(256, 128, 64, 1, 8, 3, lut="select")]


def repeated(op):
    """jit(f) running op REPEAT times with a carried dependency so nothing is hoisted or cached."""

    def run(a, *rest):
        def body(i, carry):
            out = op(a + carry, *rest)
            return (out.reshape(-1)[:1].astype(a.dtype) * 0).reshape((1,) * a.ndim)

        return jax.lax.fori_loop(0, REPEAT, body, jnp.zeros((1,) * a.ndim, a.dtype))

    return jax.jit(run)


def time_us(fn, *args, iters: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / REPEAT


def tiles_name(t: MatmulTiles) -> str:
    kind = "gemv" if t.gemv else "wfirst" if t.weight_first else "fused"
    return f"{kind}-m{t.block_m}n{t.block_n}b{t.block_bytes}s{t.split}w{t.num_warps}p{t.num_stages}-{t.lut}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,16,128,2048,8192,16384")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dirs", default="fwd,dx")
    parser.add_argument("--out", default=None, help="write the fastest variant per case as JSON")
    args = parser.parse_args()
    print(json.dumps({"device": jax.local_devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    rng = np.random.default_rng(0)
    rows, table = [], []
    for shape_name in args.shapes.split(","):
        n, k = SHAPES[shape_name]
        codes = jnp.asarray(rng.integers(0, 256, (n, k // 2), dtype=np.uint8))
        absmax = jnp.asarray(rng.uniform(0.01, 0.1, (n, k // 64)).astype(np.float32))
        w = nf4_dequantize_reference(codes, absmax)
        for m in [int(s) for s in args.ms.split(",")]:
            for direction in args.dirs.split(","):
                a_len = k if direction == "fwd" else n
                a = jnp.asarray(rng.standard_normal((m, a_len)), jnp.bfloat16)
                flops = 2 * m * n * k
                if direction == "fwd":
                    variants = {
                        "bf16": (lambda a, w: a @ w.T, (w,)),
                        "xla": (lambda a, c, s: a @ nf4_dequantize_reference(c, s).T, (codes, absmax)),
                        "dequant+dot": (lambda a, c, s: a @ nf4_dequantize(c, s).T, (codes, absmax)),
                    }
                    variants.update({tiles_name(t): (lambda a, c, s, t=t: nf4_matmul_forward(a, c, s, tiles=t), (codes, absmax))
                                     for t in candidates(m, direction)})
                    ref = a @ w.T
                else:
                    variants = {
                        "bf16": (lambda a, w: a @ w, (w,)),
                        "xla": (lambda a, c, s: a @ nf4_dequantize_reference(c, s), (codes, absmax)),
                        "dequant+dot": (lambda a, c, s: a @ nf4_dequantize(c, s), (codes, absmax)),
                    }
                    variants.update({tiles_name(t): (lambda a, c, s, t=t: nf4_matmul_dx(a, c, s, tiles=t), (codes, absmax))
                                     for t in candidates(m, direction)})
                    ref = a @ w
                case = {}
                tiles_of = {tiles_name(t): t for t in candidates(m, direction)}
                for name, (op, rest) in variants.items():
                    row = {"shape": shape_name, "N": n, "K": k, "M": m, "dir": direction, "impl": name}
                    try:
                        got = jax.jit(op)(a, *rest)
                        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
                        row["rel_err"] = err / (float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) + 1e-30)
                        row["us"] = time_us(repeated(op), a, *rest)
                        row["tflops"] = flops / row["us"] / 1e6
                        weight_bytes = n * k * 2 if name == "bf16" else n * k // 2 + n * k // 64 * 4
                        row["gbps"] = (weight_bytes + 2 * m * (n + k)) / row["us"] / 1e3
                        case[name] = row["us"]
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is a result
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                nf4_impls = {name: us for name, us in case.items() if name != "bf16"}
                if nf4_impls:
                    best = min(nf4_impls, key=nf4_impls.get)
                    fused = {name: us for name, us in nf4_impls.items() if name in tiles_of}
                    best_fused = min(fused, key=fused.get) if fused else None
                    table.append({"N": n, "K": k, "M": m, "dir": direction, "best": best, "us": nf4_impls[best],
                                  "best_fused": best_fused and dataclasses.asdict(tiles_of[best_fused]),
                                  "best_fused_us": fused.get(best_fused),
                                  "bf16_us": case.get("bf16"), "speedup_vs_bf16": case.get("bf16", 0) / nf4_impls[best]})
    print("\n| shape | M | dir | bf16 us | xla us | dequant+dot us | best fused | fused us | best/bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t in table:
        sel = [r for r in rows if r["N"] == t["N"] and r["K"] == t["K"] and r["M"] == t["M"] and r["dir"] == t["dir"] and "us" in r]
        by = {r["impl"]: r["us"] for r in sel}
        fused = {k: v for k, v in by.items() if k.startswith(("fused", "gemv", "wfirst"))}
        fbest = min(fused, key=fused.get) if fused else "-"
        print(f"| {t['N']}x{t['K']} | {t['M']} | {t['dir']} | {by.get('bf16', 0):.1f} | {by.get('xla', 0):.1f} | "
              f"{by.get('dequant+dot', 0):.1f} | {fbest} | {fused.get(fbest, 0):.1f} | {t['speedup_vs_bf16']:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
