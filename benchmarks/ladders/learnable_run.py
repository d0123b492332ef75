"""Does a (large) checkpoint train? `jaxtune.train` end to end on a learnable synthetic task, with the load split
into reading the files and building the model on the device, and peak GPU memory and host RSS.

    PYTHONPATH=. python3 benchmarks/ladders/learnable_run.py /tmp/bnb4_llama3-70b --steps 20 --batch 1 --remat per-layer
The task: each row repeats a random phrase of words drawn from a 256-word subset of the vocabulary (a word-level
tokenizer, as benchmarks/tools/make_bnb4_checkpoint.py writes), so the loss falls from log(vocab) as the adapters learn
which words occur, then the repeats. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time

import numpy as np


def read_files_seconds(path: str) -> float:
    """Seconds to read every file of the checkpoint once (from the page cache when it is warm)."""
    t0 = time.perf_counter()
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(64 * 2**20):
                pass
    return time.perf_counter() - t0


def synthetic_rows(seq_len: int, rows: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = rng.choice(vocab - 3, 256, replace=False)
    out = []
    for _ in range(rows):
        phrase = " ".join(f"w{w}" for w in rng.choice(words, 48))
        out.append({"text": " ".join([phrase] * max(1, seq_len // 48 - 1))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", default="1", help="rows per step, or auto (at most 16 here)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--remat", default="selective")
    ap.add_argument("--compute", default="bf16")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    import jax
    from flax import nnx

    import jaxtune
    from jaxtune.parallel.distributed import peak_memory_gib

    read_s = read_files_seconds(args.model)
    t0 = time.perf_counter()
    model, tokenizer = jaxtune.from_pretrained(args.model)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    batch = "auto" if args.batch == "auto" else int(args.batch)
    rows = synthetic_rows(args.seq, (16 if batch == "auto" else batch) * (args.steps + 2), model.config.vocab_size)
    cfg = jaxtune.TrainConfig(format="text", seq_len=args.seq, micro_batch_size=batch, max_steps=args.steps,
                              learning_rate=args.lr, schedule="constant", remat=args.remat, compute=args.compute,
                              packing=False)
    records: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as run:
        result = jaxtune.train(model, tokenizer, rows, cfg, out_dir=os.path.join(run, "r"), progress=False,
                               callback=records.append)
    train_s = time.perf_counter() - t0
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.LoRAParam))[0]
    lora_b = max(float(np.abs(np.asarray(x)).max()) for path, x in leaves if "lora_b" in jax.tree_util.keystr(path))
    steady = [r["tokens_per_s"] for r in records[2:]] or [records[-1]["tokens_per_s"]]
    print(json.dumps({
        "system": "jaxtune", "model": os.path.basename(args.model.rstrip("/")), "device": jax.devices()[0].device_kind,
        "batch": result.micro_batch_size, "batch_arg": args.batch, "seq": args.seq, "remat": args.remat,
        "remat_used": result.remat, "compute": args.compute,
        "read_files_s": round(read_s, 1), "load_s": round(load_s, 1), "train_s": round(train_s, 1),
        "first_step_s": round(result.micro_batch_size * args.seq / records[0]["tokens_per_s"], 1),
        "tok_s": round(float(np.median(steady))), "mfu": records[-1].get("mfu"),
        "peak_gib": peak_memory_gib(), "host_rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "losses": [round(loss, 4) for loss in result.losses], "lora_b_abs_max": lora_b,
    }), flush=True)


if __name__ == "__main__":
    main()
