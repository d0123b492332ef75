"""FP8 block-scaled GEMM on Llama-3-8B projection shapes vs bf16, and what the FP8 path costs around it.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/kernels/fp8_matmul.py [--m 8192] [--tiles 128x128w8p4,128x256w8p3]
Per (projection, direction) it times, in microseconds per call (repeated inside one jit):
  bf16          jnp.dot of bf16 operands (cuBLAS: what the bf16 step runs)
  xla-fp8       jnp.dot of e4m3 operands, bf16 out, one scale per tensor (cuBLASLt FP8; no block scales)
  kernel-<t>-<s> the Pallas kernel per tile configuration, scales per row (and per 128-block for one tile)
  quant-act     quantizing the [M, K] bf16 activation (or output gradient) to e4m3 + block scales
  quant-weight  NF4 -> e4m3 weight + row scales (the Pallas dequant kernel)
  op-bf16 / op-fp8   the whole frozen projection, forward + input gradient, as the model runs it
and the relative error of the FP8 product (row or 128-block scales; e4m3 or e5m2 left operand) vs a float32
product of the same inputs.
Prints one JSON line per case. `--errors-only` (runs on a CPU too) prints, per projection, the relative error
of the frozen projection's forward and input gradient, bf16 and FP8, against float64 products of the same
NF4 weight and inputs (activations with a few outlier channels, as LLM activations have).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels.nf4_matmul import REPEAT, SHAPES, time_us
from jaxtune import ops
from jaxtune.quant import nf4
from jaxtune.ops.fp8_linear import fp8_weight
from pallas_kernels.fp8_matmul import Fp8Tiles, fp8_matmul, fp8_matmul_reference
from pallas_kernels.fp8_quantize import quantize_blocks


def repeated(op):
    """jit running op(*args) REPEAT times; the carry feeds the last argument so nothing is hoisted."""

    def run(*args):
        def body(i, carry):
            last = args[-1] + carry.astype(args[-1].dtype)
            out = op(*args[:-1], last)
            return out.reshape(-1)[:1].astype(jnp.float32) * 0

        return jax.lax.fori_loop(0, REPEAT, body, jnp.zeros((1,), jnp.float32))

    return jax.jit(run)


def parse_tiles(spec: str) -> Fp8Tiles:
    mn, rest = spec.split("w")  # e.g. 128x256w8p3: block_m x block_n, warps, stages
    bm, bn = mn.split("x")
    warps, stages = rest.split("p")
    return Fp8Tiles(int(bm), int(bn), int(warps), int(stages))


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def projection_errors(m: int, names) -> None:
    """Relative error of y = x Wᵀ and dx = dy W through `ops.nf4_linear`, bf16 and FP8, vs float64."""
    rng = np.random.default_rng(0)
    for name in names:
        n, k = SHAPES[name]
        q = nf4.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.02)
        w = np.asarray(nf4.dequantize(q), np.float64)
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, rng.choice(k, 8, replace=False)] *= 30.0  # outlier channels
        dy = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
        row = {"shape": name, "m": m, "n": n, "k": k}
        for mode in ("bf16", "fp8"):
            def f(x):
                with ops.frozen_compute(mode):
                    return ops.nf4_linear(x, q)

            y, vjp = jax.vjp(f, jnp.asarray(x, jnp.bfloat16))
            (dx,) = vjp(jnp.asarray(dy, jnp.bfloat16))
            x16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
            dy16 = np.asarray(jnp.asarray(dy, jnp.bfloat16), np.float64)
            row[f"rel_err_fwd_{mode}"] = round(rel_err(y, x16 @ w.T))
            row[f"rel_err_dx_{mode}"] = round(rel_err(dx, dy16 @ w))
        print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--errors-only", action="store_true")
    ap.add_argument("--tiles", default="128x128w8p4,128x256w8p3,64x128w4p4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    print(json.dumps({"device": jax.local_devices()[0].device_kind, "jax": jax.__version__, "m": args.m}), flush=True)
    if args.errors_only:
        return projection_errors(args.m, args.shapes.split(","))
    key = jax.random.key(0)
    m = args.m
    for name in args.shapes.split(","):
        n_out, k_in = SHAPES[name]
        w = 0.02 * jax.random.normal(key, (n_out, k_in), jnp.float32)
        q = nf4.quantize(w)
        wd = nf4.dequantize(q, jnp.bfloat16)
        for direction, (n, k) in (("fwd", (n_out, k_in)), ("dx", (k_in, n_out))):
            a = jax.random.normal(jax.random.fold_in(key, n + k), (m, k), jnp.bfloat16)
            b = wd if direction == "fwd" else wd.T
            row = {"shape": name, "direction": direction, "m": m, "n": n, "k": k}
            dense_b = jnp.asarray(b)
            row["bf16"] = time_us(repeated(lambda b, a: jnp.dot(a, b.T, preferred_element_type=jnp.bfloat16)),
                                  dense_b, a)
            a8, b8 = a.astype(jnp.float8_e4m3fn), dense_b.astype(jnp.float8_e4m3fn)
            row["xla-fp8"] = time_us(repeated(
                lambda b, s: (jnp.dot(a8, b.T, preferred_element_type=jnp.bfloat16) * s[0]).astype(jnp.bfloat16)),
                b8, jnp.ones((1,), jnp.bfloat16))
            for block in (None, 128):
                aq, sa = quantize_blocks(a, block)
                bq, sb = quantize_blocks(dense_b, block)
                specs = args.tiles.split(",") if block is None else args.tiles.split(",")[:1]
                for spec in specs:
                    tiles = parse_tiles(spec)
                    try:
                        row[f"kernel-{spec}-{block or 'row'}"] = time_us(repeated(
                            lambda aq, bq, sb, sa: fp8_matmul(aq, sa, bq, sb, tiles=tiles)), aq, bq, sb, sa)
                    except Exception as e:  # a tile that does not compile: say why, keep going
                        row[f"kernel-{spec}-{block or 'row'}"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            row["quant-act"] = time_us(repeated(lambda a: quantize_blocks(a)[0]), a)
            if direction == "fwd":
                row["quant-weight"] = time_us(repeated(
                    lambda c, x: fp8_weight(nf4.NF4Weight(c, q.absmax_codes, q.nested_absmax, q.offset + x[0],
                                                               q.nested_map), True, False)[0]),
                    jnp.asarray(q.codes), jnp.zeros((1,), jnp.float32))
            # accuracy of the product vs float32 of the same bf16 inputs: per row and per 128-block scales,
            # e4m3 and e5m2 for the left operand (activations or output gradients)
            ref = jnp.dot(a.astype(jnp.float32), dense_b.astype(jnp.float32).T, precision="highest")
            for block in (None, 128):
                for fmt in ("e4m3", "e5m2"):
                    aq, sa = quantize_blocks(a, block, fmt)
                    bq, sb = quantize_blocks(dense_b, block, "e4m3")
                    err = rel_err(fp8_matmul_reference(aq, sa, bq, sb, jnp.float32), ref)
                    row[f"rel_err_{fmt}_{block or 'row'}"] = round(err, 5)
            row["rel_err_bf16"] = round(rel_err(jnp.dot(a, dense_b.T, preferred_element_type=jnp.bfloat16), ref))
            print(json.dumps(row), flush=True)
        # the frozen projection as the model runs it: forward + input gradient
        x = jax.random.normal(key, (m, k_in), jnp.bfloat16)
        for mode in ("bf16", "fp8"):
            def fwd_bwd(c, x):
                weight = nf4.NF4Weight(c, q.absmax_codes, q.nested_absmax, q.offset, q.nested_map)
                with ops.frozen_compute(mode):
                    y, vjp = jax.vjp(lambda x: ops.nf4_linear(x, weight), x)
                return vjp(y)[0]
            print(json.dumps({"shape": name, "op": mode, "m": m,
                              "fwd_dx_us": time_us(repeated(fwd_bwd), jnp.asarray(q.codes), x)}), flush=True)


if __name__ == "__main__":
    main()
