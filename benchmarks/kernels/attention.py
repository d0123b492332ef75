"""Flash attention (Pallas) against cuDNN and XLA: causal and packed segments, forward and forward+backward.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/kernels/attention.py [--seqs 1024,2048,...] [--sweep] [--check]
    PYTHONPATH=. python3 benchmarks/kernels/attention.py --heads 16,4,512 --sweep-wide --check  # Gemma 4's full
32 query heads, 8 kv heads, head_dim 128 (--heads HQ,HKV,D), bf16, batch 1 (--batch), no window (--window). "fwd+bwd" times the forward and backward
together (one vjp). TFLOP/s counts only unmasked work: 4*D*H per visible (query, key) pair forward,
2.5x that backward. Prints JSON lines and a markdown table.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.steps.forward_llama8b import time_fn
from pallas_kernels.flash_attention import AttentionTiles, attention_reference, flash_attention

HQ, HKV, D = 32, 8, 128


def packed_segments(t: int, seed: int = 0) -> np.ndarray:
    """Documents of 128..2048 tokens filling T, as sample packing would lay them out."""
    rng = np.random.default_rng(seed)
    ids, pos, seg = np.zeros(t, np.int32), 0, 1
    while pos < t:
        n = int(rng.integers(128, 2049))
        ids[pos : pos + n] = seg
        pos, seg = pos + n, seg + 1
    return ids[None]


def unmasked_pairs(t: int, segment_ids: np.ndarray | None) -> float:
    if segment_ids is None:
        return t * (t + 1) / 2
    _, counts = np.unique(segment_ids[0], return_counts=True)
    return float(sum(c * (c + 1) / 2 for c in counts))


def variants(segment_ids, tiles_list, window=None):
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    out = {}
    for name, tiles in tiles_list:
        out[f"pallas{name}"] = lambda q, k, v, tiles=tiles: flash_attention(q, k, v, seg, tiles=tiles,
                                                                            sliding_window=window)
    if window is not None:
        out["xla"] = lambda q, k, v: attention_reference(q, k, v, seg, sliding_window=window)
        return out
    if seg is None:
        out["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    else:
        def cudnn_mask(q, k, v):
            mask = (seg[:, :, None] == seg[:, None, :]) & jnp.tri(seg.shape[1], dtype=bool)[None]
            return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="cudnn")

        out["cudnn-mask"] = cudnn_mask
    out["xla"] = lambda q, k, v: attention_reference(q, k, v, seg)
    return out


def measure(t: int, packed: bool, tiles_list, check: bool, batch: int = 1, window: int | None = None) -> list[dict]:
    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (batch, t, HQ, D), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, t, HKV, D), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, t, HKV, D), jnp.bfloat16)
    do = jax.random.normal(keys[3], (batch, t, HQ, D), jnp.bfloat16)
    segment_ids = np.repeat(packed_segments(t), batch, axis=0) if packed else None
    fwd_flops = 4 * unmasked_pairs(t, segment_ids) * D * HQ * batch
    rows, ref = [], None
    for name, fn in variants(segment_ids, tiles_list, window).items():
        if name == "xla" and t > 8192:
            continue
        if name == "cudnn-mask" and t > 16384:
            continue
        fwd = jax.jit(fn)
        both = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](do))
        row = {"T": t, "batch": batch, "packed": packed, "impl": name, "heads": [HQ, HKV, D], "window": window}
        try:
            row["fwd_ms"] = 1e3 * time_fn(fwd, q, k, v)
            row["fwdbwd_ms"] = 1e3 * time_fn(both, q, k, v)
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
            row["fwdbwd_tflops"] = 3.5 * fwd_flops / row["fwdbwd_ms"] / 1e9
            if check:
                got = (fwd(q, k, v), *both(q, k, v))
                if ref is None and t <= 4096:
                    ref_fn = lambda q, k, v: attention_reference(q, k, v, None if segment_ids is None else jnp.asarray(segment_ids), sliding_window=window)  # noqa: E731,E501
                    ref = (jax.jit(ref_fn)(q, k, v), *jax.jit(lambda q, k, v: jax.vjp(ref_fn, q, k, v)[1](do))(q, k, v))
                if ref is not None:
                    row["max_err"] = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(got, ref)]
        except Exception as e:  # noqa: BLE001 - a variant that does not run is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


SWEEP = [  # forward at the default tiles; backward (block_q, block_k, warps, stages) varied
    ("-default", AttentionTiles()),
    ("-bwd64x128w8s2", AttentionTiles(128, 128, 8, 2, 64, 128, 8, 2)),
    ("-bwd128x64w8s2", AttentionTiles(128, 128, 8, 2, 128, 64, 8, 2)),
    ("-bwd128x128w8s1", AttentionTiles(128, 128, 8, 2, 128, 128, 8, 1)),
    ("-bwd64x64w4s3", AttentionTiles(128, 128, 8, 2, 64, 64, 4, 3)),
    ("-bwd32x64w4s3", AttentionTiles(128, 128, 8, 2, 32, 64, 4, 3)),
    ("-bwd64x128w4s2", AttentionTiles(128, 128, 8, 2, 64, 128, 4, 2)),
    ("-bwd64x64w8s2", AttentionTiles(128, 128, 8, 2, 64, 64, 8, 2)),
]
WIDE_SWEEP = [  # heads of 256 / 512: the default wide tiles (flash_attention.WIDE_TILES) and neighbours
    ("-wide-default", None),
    ("-f64x32w8s1-b32x16w8s1", AttentionTiles(64, 32, 8, 1, 32, 16, 8, 1)),
    ("-f32x32w4s1-b16x16w4s1", AttentionTiles(32, 32, 4, 1, 16, 16, 4, 1)),
    ("-f64x64w8s1-b32x32w8s1", AttentionTiles(64, 64, 8, 1, 32, 32, 8, 1)),
    ("-f32x64w8s2-b16x32w8s1", AttentionTiles(32, 64, 8, 2, 16, 32, 8, 1)),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--sweep", action="store_true", help="time several tile configurations")
    parser.add_argument("--check", action="store_true", help="compare outputs and grads with the XLA reference")
    parser.add_argument("--no-packed", action="store_true")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", default="32,8,128", help="query heads, kv heads, head dim")
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--sweep-wide", action="store_true", help="time tile configurations of heads of 256 / 512")
    args = parser.parse_args()
    global HQ, HKV, D
    HQ, HKV, D = (int(x) for x in args.heads.split(","))
    tiles_list = SWEEP if args.sweep else [("", AttentionTiles())]
    if args.sweep_wide:
        from pallas_kernels.flash_attention import tiles_for

        tiles_list = [(name, tiles or tiles_for(D)) for name, tiles in WIDE_SWEEP]
    print(json.dumps({"device": jax.local_devices()[0].device_kind, "jax": jax.__version__}))
    rows = []
    for t in [int(s) for s in args.seqs.split(",")]:
        rows += measure(t, False, tiles_list, args.check, args.batch, args.window)
        if not args.no_packed:
            rows += measure(t, True, tiles_list, args.check, args.batch, args.window)
    print("\n| T | packed | impl | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['T']} | {r['packed']} | {r['impl']} | {r['error']} | | | |")
        else:
            print(f"| {r['T']} | {r['packed']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | "
                  f"{r['fwdbwd_ms']:.3f} | {r['fwdbwd_tflops']:.0f} |")


if __name__ == "__main__":
    main()
