"""FP8 vs bf16 accuracy on the demo task: the bundled SmolLM2 fine-tuned the same way twice.

    python benchmarks/accuracy/fp8_accuracy.py [--steps 200] [--out runs/fp8-accuracy] [--bf16-from RUN.jsonl]
                                      [--eval-prompts N]
Both runs share the converted checkpoint, data, seed and LoRA init; only `TrainConfig.compute` differs. On a CPU
the model computes in float32 and FP8 runs as its jnp reference (the same quantization as the GPU path). Prints
one JSON line per run (losses, held-out exact match) and one comparing them: the largest relative gap between
the two loss curves (each smoothed over 10 steps), the final losses, the exact-match difference in points.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

import jaxtune
from examples.demo import DATA, exact_match
from examples.make_demo_data import more_heldout


def smoothed(losses: list[float], window: int = 10) -> np.ndarray:
    x = np.asarray(losses, np.float64)
    return np.convolve(x, np.ones(window) / window, mode="valid")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="runs/fp8-accuracy")
    ap.add_argument("--bf16-from", help="a bf16 JSON line this script printed before (same steps): train FP8 only")
    ap.add_argument("--eval-prompts", type=int, default=24,
                    help="held-out prompts scored: the demo's 24, then more made the same way (names unseen in training)")
    args = ap.parse_args()
    out = Path(args.out)
    converted = out / "smollm2-nf4"
    if not (converted / "jaxtune.json").exists():
        jaxtune.convert("smollm2", converted, quantize="nf4")
    on_cpu = jax.local_devices()[0].platform == "cpu"
    evals = [json.loads(line) for line in (DATA / "people_eval.jsonl").read_text().splitlines()]
    evals += more_heldout(max(0, args.eval_prompts - len(evals)))
    runs = {}
    if args.bf16_from:
        runs["bf16"] = json.loads(Path(args.bf16_from).read_text().splitlines()[0])
    for compute in [c for c in ("bf16", "fp8") if c not in runs]:
        model, tokenizer = jaxtune.from_pretrained(converted, dtype="float32" if on_cpu else "bfloat16")
        cfg = jaxtune.TrainConfig(format="chat", seq_len=192, micro_batch_size=4, max_steps=args.steps,
                                  learning_rate=1e-3, schedule="cosine", warmup_steps=3, lora_r=16, lora_alpha=32,
                                  compute=compute)
        t0 = time.perf_counter()
        result = jaxtune.train(model, tokenizer, DATA / "people_train.jsonl", cfg, progress=False)
        seconds = time.perf_counter() - t0
        score, _ = exact_match(model, tokenizer, evals)
        runs[compute] = {"compute": compute, "device": jax.local_devices()[0].device_kind, "steps": result.steps,
                         "train_s": round(seconds, 1), "eval_prompts": len(evals), "exact_match": score,
                         "final_loss": result.losses[-1],
                         "losses": [round(x, 5) for x in result.losses]}
        print(json.dumps(runs[compute]), flush=True)
    ref, fp8 = smoothed(runs["bf16"]["losses"]), smoothed(runs["fp8"]["losses"])
    print(json.dumps({
        "compare": "fp8 vs bf16", "max_rel_gap_smoothed": round(float(np.max(np.abs(fp8 - ref) / ref)), 5),
        "mean_rel_gap_smoothed": round(float(np.mean(np.abs(fp8 - ref) / ref)), 5),
        "final_loss": [runs["bf16"]["final_loss"], runs["fp8"]["final_loss"]],
        "exact_match_points": round(100 * (runs["fp8"]["exact_match"] - runs["bf16"]["exact_match"]), 1),
    }), flush=True)


if __name__ == "__main__":
    main()
