"""Each kernel of `pallas_kernels/gated_delta.py` timed alone, over a sweep of its launch settings, at Qwen3.5
linear-attention shapes (16 key heads, 32 value heads, dk = dv = 128, bf16 q/k/v): where the forward and the
backward spend their time, and which settings are fastest.

    PYTHONPATH=$PWD python benchmarks/kernels/gated_delta_parts.py [--shapes 2x4096,1x16384] [--block-v 32,64]

One JSON line per (shape, block_v, warps, kernel): milliseconds per call (median of 20 after warm-up).
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from gated_delta_vs_fla import inputs, time_ms
from pallas_kernels import gated_delta as gd


def prepared(b: int, t: int):
    q, k, v, g, beta, w = inputs(b, t)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    gam, fs, te, keep, seg = gd.chunk_factors(jnp.asarray(g), None, False, gd.CHUNK)
    beta = jnp.moveaxis(jnp.asarray(beta), 2, 1)
    s0 = jnp.zeros((b, v.shape[2], q.shape[-1], v.shape[-1]), jnp.float32)
    return q, k, v, beta, gam, fs, te, keep, seg, s0, jnp.asarray(w, jnp.bfloat16)


def parts(b: int, t: int):
    """{kernel: ms} for the current settings."""
    q, k, v, beta, gam, fs, te, keep, seg, s0, do = prepared(b, t)
    group, c = v.shape[2] // k.shape[2], gd.CHUNK
    wy = jax.jit(lambda: gd._wy(k, v, beta, gam, fs, seg, group, c, False, False))
    wy_t = jax.jit(lambda: gd._wy(k, v, beta, gam, fs, seg, group, c, True, False))
    u, w = wy()
    _, _, t_ = wy_t()
    states = jax.jit(lambda: gd._state_pass(w, u, k, te, keep, s0, group, c, False))
    vn, st, _ = states()
    out = jax.jit(lambda: gd._output(q, k, vn, st, gam, fs, seg, group, c, v.dtype, False))
    sgrad = jax.jit(lambda: gd._state_grads(q, k, w, do, gam, fs, te, keep, seg, s0, group, c, False))
    dvn, dafter, _ = sgrad()
    cgrad = jax.jit(lambda: gd._chunk_grads(q, k, v, vn, dvn, do, st, dafter, t_, beta, gam, fs, te, seg, group, c,
                                            False))
    sync = jax.block_until_ready
    return {name: round(time_ms(fn, sync), 3) for name, fn in
            [("wy", wy), ("wy_with_t", wy_t), ("states", states), ("output", out), ("state_grads", sgrad),
             ("chunk_grads", cgrad)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2x4096,1x16384")
    ap.add_argument("--block-v", default="32,64")
    ap.add_argument("--warps", default="4,8", help="warps tried for every kernel (one setting per run)")
    ap.add_argument("--accuracy", action="store_true", help="only compare the gradients with the XLA path's")
    args = ap.parse_args()
    if args.accuracy:
        for shape in args.shapes.split(","):
            accuracy(*map(int, shape.split("x")))
        return
    device = jax.local_devices()[0].device_kind
    for shape in args.shapes.split(","):
        b, t = map(int, shape.split("x"))
        for block_v, warps in itertools.product(map(int, args.block_v.split(",")), map(int, args.warps.split(","))):
            gd.BLOCK_V = block_v
            gd.WARPS = {name: warps for name in gd.WARPS}
            try:
                times = parts(b, t)
            except Exception as e:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
                times = {"error": f"{type(e).__name__}: {e}"[:200]}
            print(json.dumps({"shape": shape, "block_v": block_v, "warps": warps, **times, "device": device}),
                  flush=True)


def accuracy(b: int, t: int) -> None:
    """The kernel's gradients against the XLA path's in float32 inputs, largest relative difference and where."""
    from jaxtune.ops.gated_delta import gated_delta_rule_chunked

    q, k, v, g, beta, w = (jnp.asarray(x) for x in inputs(b, t))
    for dtype in (jnp.float32, jnp.bfloat16):
        qq, kk, vv = (x.astype(dtype) for x in (q, k, v))
        grads = []
        for rule in (gd.gated_delta_rule_pallas, gated_delta_rule_chunked):
            loss = lambda *a, rule=rule: jnp.sum(rule(*a)[0].astype(jnp.float32) * w)  # noqa: E731
            grads.append(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(qq, kk, vv, g, beta))
        for name, a, b_ in zip("q k v g beta".split(), *grads):
            d = np.abs(np.asarray(a, np.float32) - np.asarray(b_, np.float32))
            print(json.dumps({"shape": f"{b}x{t}", "dtype": jnp.dtype(dtype).name, "grad": name,
                              "rel": float(d.max() / np.abs(np.asarray(b_, np.float32)).max()),
                              "at": [int(i) for i in np.unravel_index(d.argmax(), d.shape)]}), flush=True)


if __name__ == "__main__":
    main()
