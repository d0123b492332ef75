"""The experts' grouped GEMM (`jaxtune.moe.grouped_matmul`, jax.lax.ragged_dot) against one cuBLAS GEMM of the
same FLOPs, on a mixture of experts' training shapes, and the NF4 dequantization of a layer's experts.

    PYTHONPATH=. python3 benchmarks/moe/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 8192
Prints one JSON line per projection and implementation (the Pallas kernel at several tilings; --xla: also
XLA's ragged_dot; --tokamax: tokamax's ragged_dot (Mosaic GPU on Hopper); --fp8: the grouped FP8 kernel at
several tilings beside cuBLASLt's dense FP8 GEMM; --weight-grad: LoRA's per-expert gradients): milliseconds
and TFLOP/s of the grouped GEMM (forward; input gradient, as QLoRA's frozen
experts need) and of the dense GEMM of the same rows, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtune
from jaxtune.quant import nf4
from jaxtune.moe.grouped import grouped_matmul
from jaxtune.moe.layout import BLOCK_M, tile_layout
from pallas_kernels.grouped_matmul import GroupedTiles, grouped_matmul as kernel
from pallas_kernels.grouped_fp8_matmul import GroupedFp8Tiles, fp8_expert_weights, grouped_fp8_matmul
from pallas_kernels.grouped_matmul_wgmma import WgmmaTiles, fits, frozen_ragged_matmul

SHAPES = {  # hidden, expert width, experts, experts per token
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "smoke": (128, 64, 4, 2),  # a CPU check of this script (interpret mode)
}


# (block_m, block_n, block_k, warps, stages)
INTERPRET = jax.default_backend() != "gpu"  # a check run on CPU
TILES = [GroupedTiles(64, 128, 64, 4, 3), GroupedTiles(128, 128, 64, 8, 3), GroupedTiles(64, 256, 64, 8, 3),
         GroupedTiles(128, 256, 64, 8, 3), GroupedTiles(64, 256, 64, 8, 4)]
# (block_m, block_n, block_k, stages, grid_block_n): JAX's Mosaic GPU ragged dot (--wgmma, Hopper only)
FP8_TILES = [GroupedFp8Tiles(128, 128, 128, 8, 4), GroupedFp8Tiles(128, 256, 128, 8, 3),
             GroupedFp8Tiles(64, 128, 128, 4, 4), GroupedFp8Tiles(128, 128, 64, 8, 4),
             GroupedFp8Tiles(64, 256, 128, 8, 3)]
WGMMA_TILES = [WgmmaTiles(128, 128, 64, 4, 1), WgmmaTiles(128, 128, 64, 5, 1), WgmmaTiles(128, 256, 64, 3, 1),
               WgmmaTiles(128, 256, 64, 4, 1), WgmmaTiles(128, 128, 64, 4, 2), WgmmaTiles(128, 192, 64, 4, 1),
               WgmmaTiles(64, 256, 64, 4, 1)]


def timed(fn, *args, reps: int = 20) -> float:
    """Median milliseconds of one call (compiled, warmed up)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def weight_grads(chosen, experts: int, hidden: int, width: int, rows: int, key, model: str, rank: int = 16) -> None:
    """LoRA's factor gradients of every expert (dA of gate/up [E, r, hidden], dB of gate/up [E, width, r], dA of
    down [E, r, width], dB of down [E, hidden, r]): `grouped_weight_grad` against the per-tile batched GEMMs summed
    per expert (`grouped_weight_grad_reference`), one JSON line each."""
    from pallas_kernels.grouped_matmul import grouped_weight_grad, grouped_weight_grad_reference

    layout = tile_layout(chosen, experts, BLOCK_M)
    for name, (n, k) in {"gate_up.A": (rank, hidden), "gate_up.B": (width, rank), "down.A": (rank, width),
                         "down.B": (hidden, rank)}.items():
        dy = jax.random.normal(key, (layout.rows, n), jnp.bfloat16)
        x = jax.random.normal(jax.random.fold_in(key, 1), (layout.rows, k), jnp.bfloat16)
        ref = jax.jit(lambda d, x: grouped_weight_grad_reference(d, x, layout.tile_group, experts, BLOCK_M))
        line = {"model": model, "weight_grad": name, "rows": rows, "n": n, "k": k, "experts": experts,
                "device": jax.devices()[0].device_kind, "per_tile_sum_ms": round(timed(ref, dy, x), 3)}
        for bn, bk in ((16, 64), (16, 128), (64, 16), (128, 16), (64, 64)):
            fn = jax.jit(lambda d, x, bn=bn, bk=bk: grouped_weight_grad(d, x, layout.tile_group, experts, BLOCK_M,
                                                                       block_n=bn, block_k=bk, interpret=INTERPRET))
            try:
                line[f"kernel_{bn}x{bk}_ms"] = round(timed(fn, dy, x), 3)
            except Exception as err:  # a tiling the shape does not take: recorded, not fatal
                line[f"kernel_{bn}x{bk}_error"] = str(err).splitlines()[0][:120]
        print(json.dumps(line), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--xla", action="store_true", help="also time XLA's ragged_dot")
    ap.add_argument("--wgmma", action="store_true", help="also time JAX's Mosaic GPU ragged dot (Hopper)")
    ap.add_argument("--only-wgmma", action="store_true", help="time the wgmma kernel's tilings alone")
    ap.add_argument("--weight-grad", action="store_true",
                    help="time LoRA's per-expert factor gradients: the one-kernel sum against per-tile GEMMs summed")
    ap.add_argument("--tokamax", action="store_true",
                    help="also time tokamax.ragged_dot (PYTHONPATH: a site with tokamax, benchmarks/moe/site_shims)")
    ap.add_argument("--fp8", action="store_true", help="also time the grouped FP8 kernel (and a dense FP8 GEMM)")
    args = ap.parse_args()
    hidden, width, experts, top_k = SHAPES[args.model]
    rows = args.tokens * top_k
    rng = np.random.default_rng(0)
    # a router's choice over random tokens: near-uniform groups (what a trained router's balancing loss aims at)
    chosen = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(args.tokens)]))
    key = jax.random.key(0)
    if args.weight_grad:
        weight_grads(chosen, experts, hidden, width, rows, key, args.model)
    for name, (k, n) in {"gate_up": (hidden, width), "down": (width, hidden)}.items():
        w = (0.02 * jax.random.normal(key, (experts, n, k), jnp.float32)).astype(jnp.bfloat16)
        dense_w = w[0]
        flops = 2.0 * rows * k * n
        x = jax.random.normal(key, (rows, k), jnp.bfloat16)
        dense = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        dy = jax.random.normal(key, (rows, n), jnp.bfloat16)
        dense_dx = jax.jit(lambda x, w, dy: jax.vjp(lambda x: jnp.dot(x, w.T).astype(jnp.bfloat16), x)[1](dy)[0])
        d, ddx = timed(dense, x, dense_w), timed(dense_dx, x, dense_w, dy)
        q = jax.jit(jax.vmap(nf4.quantize_traced))(w)
        dequant = timed(jax.jit(lambda q: nf4.dequantize(q, jnp.bfloat16)), q)
        record = {"model": args.model, "projection": name, "rows": rows, "k": k, "n": n, "experts": experts,
                  "device": jax.devices()[0].device_kind, "dense_ms": round(d, 3),
                  "dense_tflops": round(flops / d / 1e9, 1), "dense_dx_ms": round(ddx, 3),
                  "nf4_dequant_all_experts_ms": round(dequant, 3)}
        if args.fp8 and not INTERPRET:
            xq, wq = x.astype(jnp.float8_e4m3fn), dense_w.astype(jnp.float8_e4m3fn)
            dense_fp8 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                                                                 preferred_element_type=jnp.bfloat16))
            record["dense_fp8_ms"] = round(timed(dense_fp8, xq, wq), 3)
        variants = [("xla", None)] if args.xla else []
        variants += [] if args.only_wgmma else [("pallas", t) for t in TILES]
        variants += [("wgmma", t) for t in WGMMA_TILES if fits(k, n, t) and fits(n, k, t)] \
            if args.wgmma or args.only_wgmma else []
        variants += [("fp8", t) for t in FP8_TILES] if args.fp8 else []
        variants += [("tokamax", None)] if args.tokamax else []
        for impl, tiles in variants:
            jaxtune.set_kernels("xla" if impl == "xla" else "pallas-interpret" if INTERPRET else "pallas")
            layout = tile_layout(chosen, experts, BLOCK_M if tiles is None else tiles.block_m)
            xp = jax.random.normal(key, (layout.rows, k), jnp.bfloat16)
            dyp = jax.random.normal(key, (layout.rows, n), jnp.bfloat16)
            operand = w
            if impl == "tokamax":  # unpadded rows grouped by expert, the weight as [E, K, N]
                import tokamax

                sizes = jnp.bincount(chosen.reshape(-1), length=experts).astype(jnp.int32)
                operand = jnp.swapaxes(w, 1, 2)
                xp = jax.random.normal(key, (rows, k), jnp.bfloat16)
                dyp = jax.random.normal(key, (rows, n), jnp.bfloat16)
                fwd = jax.jit(lambda x, w: tokamax.ragged_dot(x, w, sizes))
                dx = jax.jit(lambda x, w, dy: jax.vjp(lambda x: tokamax.ragged_dot(x, w, sizes), x)[1](dy)[0])
            elif impl == "fp8":
                frozen = jax.jit(fp8_expert_weights)(w)
                fwd = jax.jit(lambda x, w, t=tiles: grouped_fp8_matmul(x, frozen, layout.tile_group, t,
                                                                        "pallas-interpret" if INTERPRET else "pallas"))
                dx = jax.jit(lambda x, w, dy, t=tiles: jax.vjp(lambda x: grouped_fp8_matmul(
                    x, frozen, layout.tile_group, t, "pallas-interpret" if INTERPRET else "pallas"), x)[1](dy)[0])
            elif impl == "wgmma":
                fwd = jax.jit(lambda x, w, t=tiles: frozen_ragged_matmul(x, w, layout.group_sizes, t))
                dx = jax.jit(lambda x, w, dy, t=tiles: jax.vjp(
                    lambda x: frozen_ragged_matmul(x, w, layout.group_sizes, t), x)[1](dy)[0])
            elif tiles is None:
                fwd = jax.jit(lambda x, w: grouped_matmul(x, w, layout))
                dx = jax.jit(lambda x, w, dy: jax.vjp(lambda x: grouped_matmul(x, w, layout), x)[1](dy)[0])
            else:
                fwd = jax.jit(lambda x, w, t=tiles: kernel(x, w, layout.tile_group, t, INTERPRET))
                dx = jax.jit(lambda x, w, dy, t=tiles: jax.vjp(lambda x: kernel(x, w, layout.tile_group, t, INTERPRET),
                                                                x)[1](dy)[0])
            named = {**record, "impl": impl, "tiles": None if tiles is None else list(tiles.__dict__.values())}
            try:
                g, gdx = timed(fwd, xp, operand), timed(dx, xp, operand, dyp)
            except Exception as err:  # a tiling past shared memory: recorded, not fatal
                print(json.dumps({**named, "error": str(err).splitlines()[0][:200]}), flush=True)
                continue
            print(json.dumps({**named, "padded_rows": layout.rows, "grouped_ms": round(g, 3),
                              "grouped_tflops": round(flops / g / 1e9, 1), "grouped_vs_dense": round(d / g, 3),
                              "grouped_dx_ms": round(gdx, 3), "dx_grouped_vs_dense": round(ddx / gdx, 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
