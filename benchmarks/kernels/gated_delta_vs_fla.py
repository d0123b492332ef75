"""The chunked gated delta rule: jaxtune's Pallas kernel and XLA path against flash-linear-attention's Triton
`chunk_gated_delta_rule`,
forward and forward + backward, at Qwen3.5 / Qwen3-Next linear-attention shapes (16 key heads, 32 value heads,
dk = dv = 128), bf16 q/k/v (L2-normalised beforehand), float32 g and beta, the same inputs on both sides.

    pip download --no-deps fla-core==0.4.0 einops; pip install --no-deps --target .fla-site *.whl
    (fla-core 0.6 refuses the device's Triton 3.6 on Hopper for its backward; 0.4.0 runs there)
    # on the GPU machine, carrying .fla-site:
    PYTHONPATH=$PWD:$PWD/.fla-site python benchmarks/kernels/gated_delta_vs_fla.py [--shapes 2x4096,1x16384]

One JSON line per (side, shape): milliseconds per call (median of 20 after warm-up), forward and forward + backward,
for jaxtune's Pallas kernel (`pallas_kernels/gated_delta.py`), its XLA path and fla; the largest difference of the
outputs from fla's, and of each gradient relative to fla's largest.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

HK, HV, DK, DV = 16, 32, 128, 128


def inputs(b: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, t, HK, DK)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((b, t, HV, DV)).astype(np.float32)
    g = -np.exp(rng.normal(-2.0, 1.0, (b, t, HV))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, HV))))).astype(np.float32)
    w = rng.standard_normal((b, t, HV, DV)).astype(np.float32)
    return q, k, v, g, beta, w


def time_ms(fn, sync, iters: int = 20) -> float:
    for _ in range(3):
        sync(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sync(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def jaxtune_side(arrays, path: str):
    import jax
    import jax.numpy as jnp

    from jaxtune.ops.gated_delta import gated_delta_rule_chunked
    from pallas_kernels.gated_delta import gated_delta_rule_pallas

    q, k, v, g, beta, w = arrays
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    g, beta, w = (jnp.asarray(x) for x in (g, beta, w))
    rule = gated_delta_rule_pallas if path == "pallas" else gated_delta_rule_chunked
    fwd = jax.jit(lambda *a: rule(*a)[0])
    grad = jax.jit(jax.grad(lambda q, k, v, g, b: jnp.sum(fwd(q, k, v, g, b).astype(jnp.float32) * w),
                            argnums=(0, 1, 2, 3, 4)))
    out = np.asarray(fwd(q, k, v, g, beta).astype(jnp.float32))
    grads = [np.asarray(x.astype(jnp.float32)) for x in grad(q, k, v, g, beta)]
    sync = jax.block_until_ready
    return (out, grads, time_ms(lambda: fwd(q, k, v, g, beta), sync),
            time_ms(lambda: grad(q, k, v, g, beta), sync))


def fla_side(arrays):
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, w = (torch.from_numpy(x).cuda() for x in arrays)
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    g, beta = g.requires_grad_(), beta.requires_grad_()

    def fwd():  # grouped value heads as transformers' Qwen3-Next feeds fla: q and k repeated to the value heads
        rep = HV // HK
        return chunk_gated_delta_rule(q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2), v, g, beta)[0]

    def both():
        out = fwd()
        return torch.autograd.grad((out.float() * w).sum(), (q, k, v, g, beta))

    with torch.no_grad():
        out = fwd().float().cpu().numpy()
    grads = [x.float().cpu().numpy() for x in both()]
    sync = lambda _: torch.cuda.synchronize()  # noqa: E731
    return out, grads, time_ms(lambda: fwd().detach(), sync), time_ms(both, sync)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="2x4096,1x16384")
    ap.add_argument("--paths", default="pallas,xla", help="jaxtune's sides: pallas, xla")
    args = ap.parse_args()
    import jax

    device = jax.local_devices()[0].device_kind
    for shape in args.shapes.split(","):
        b, t = map(int, shape.split("x"))
        arrays = inputs(b, t)
        ours = {path: jaxtune_side(arrays, path) for path in args.paths.split(",")}
        try:
            theirs = fla_side(arrays)
        except Exception as e:  # noqa: BLE001 - the baseline is optional where fla is not installed
            print(json.dumps({"shape": shape, "fla": f"unavailable: {type(e).__name__}: {e}"[:300]}), flush=True)
            theirs = None
        sides = [(f"jaxtune-{p}", r) for p, r in ours.items()] + ([("fla-triton", theirs)] if theirs else [])
        for side, (out, grads, f, fb) in sides:
            row = {"side": side, "shape": shape, "tokens": b * t, "forward_ms": round(f, 3),
                   "forward_backward_ms": round(fb, 3), "device": device}
            if theirs is not None and side != "fla-triton":
                row["max_abs_diff"] = float(np.abs(out - theirs[0]).max())
                row["grad_rel_diff"] = [round(float(np.abs(a - b_).max() / (np.abs(b_).max() + 1e-12)), 5)
                                        for a, b_ in zip(grads, theirs[1])]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
