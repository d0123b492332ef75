"""QLoRA training throughput of jaxtune on a Llama-3-8B-shaped checkpoint (random token ids, seq 2048).

On the GPU machine, from the repository root, after benchmarks/convert_llama8b.py made and converted the
checkpoint:
    PYTHONPATH=. python3 benchmarks/train_qlora.py /tmp/jt-8b --batch 1 [--remat none|per-layer|offload]
    PYTHONPATH=. python3 benchmarks/train_qlora.py /tmp/jt-8b --batch auto
Prints one JSON line per run: tokens/s, MFU (31.6 GFLOP/token style count over 989 TFLOP/s), peak GiB.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxtune
from jaxtune.training.autobatch import choose_micro_batch
from jaxtune.training.loop import PEAK_BF16_FLOPS, flops_per_token
from jaxtune.training.step import REMAT_POLICIES, make_optimizer, make_train_step, split_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--remat", default="none", choices=list(REMAT_POLICIES))
    args = ap.parse_args()

    model, _ = jaxtune.from_pretrained(args.model, load_in_4bit=True)
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    model.remat_policy = REMAT_POLICIES[args.remat]
    cfg = jaxtune.TrainConfig(seq_len=args.seq, micro_batch_size=args.batch if args.batch == "auto" else int(args.batch),
                              max_steps=1000, learning_rate=1e-4, remat=args.remat)
    graphdef, lora, frozen = split_model(model)
    optimizer, schedule = make_optimizer(cfg)
    opt_state = optimizer.init(lora)
    step_fn = make_train_step(graphdef, optimizer, schedule, cfg)
    t0 = time.perf_counter()
    micro = choose_micro_batch(cfg, step_fn, lora, opt_state, frozen) if args.batch == "auto" else int(args.batch)
    choose_s = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    shape = (1, micro, args.seq)
    ids = rng.integers(0, model.config.vocab_size, shape).astype(np.int32)
    batch = {"input_ids": ids, "labels": np.roll(ids, -1, axis=-1), "segment_ids": np.ones(shape, np.int32),
             "positions": np.broadcast_to(np.arange(args.seq, dtype=np.int32), shape).copy()}
    batch["labels"][..., -1] = -1
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    t0 = time.perf_counter()
    lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jnp.int32(0))
    jax.block_until_ready(m)
    first_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jnp.int32(i))
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(args.steps):
        lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jnp.int32(args.warmup + i))
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / args.steps
    tok_s = micro * args.seq / dt
    stats = jax.devices()[0].memory_stats() or {}
    print(json.dumps({
        "system": "jaxtune", "device": jax.devices()[0].device_kind, "batch": micro, "batch_arg": args.batch,
        "seq": args.seq, "remat": args.remat, "step_s": round(dt, 4), "tok_s": round(tok_s),
        "mfu": round(tok_s * flops_per_token(model, args.seq) / PEAK_BF16_FLOPS, 3),
        "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 2), "first_step_s": round(first_s, 1),
        "auto_batch_s": round(choose_s, 1), "loss": float(m["loss"]),
    }), flush=True)


if __name__ == "__main__":
    main()
