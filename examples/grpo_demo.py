"""GRPO on the bundled model: reinforcement learning from verifiable rewards, on CPU in minutes.

SmolLM2-135M-Instruct answers small additions ("What is 3 + 5?") in a sentence, right about a fifth of the
time. Each step samples 8 answers to each of 4 questions from the policy being trained, scores them with a
verifiable reward (the built-in last_number: the answer's last number equals the row's `answer` column) and moves
the LoRA adapters toward the better answers of each group (TRL's GRPO loss). Held-out questions are answered
greedily before and after.

    python examples/grpo_demo.py [--steps 20] [--out runs/grpo-demo] [--eval-limit N]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import jax

import jaxtune
from bundled_smollm2 import load_converted
from jaxtune.rl.rewards import last_number


def additions(n: int, seed: int) -> list[dict]:
    """Questions on two single-digit numbers, with the sum as the `answer` column the reward reads."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "answer": str(a + b)})
    return rows


def accuracy(model, tokenizer, rows: list[dict]) -> tuple[float, list[str]]:
    """(share of greedy answers whose last number is the sum, the answers)."""
    outputs = jaxtune.generate(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=24)
    return sum(last_number(None, outputs, answer=[r["answer"] for r in rows])) / len(rows), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="runs/grpo-demo")
    ap.add_argument("--eval-limit", type=int, default=None, help="score the first N held-out questions only")
    ap.add_argument("--prompts-per-step", type=int, default=4, help="questions per step, 8 answers sampled to each")
    args = ap.parse_args()
    start = time.perf_counter()
    out = Path(args.out)
    model, tokenizer, converted = load_converted(out)
    held_out = additions(32, seed=1)[:args.eval_limit]

    print(f"[2/4] the base model answers {len(held_out)} held-out additions (greedy)")
    right_before, before = accuracy(model, tokenizer, held_out)

    print(f"[3/4] GRPO for {args.steps} steps: 8 sampled answers to each of {args.prompts_per_step} questions per step")
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)
    cfg = jaxtune.TrainConfig(objective="grpo", num_generations=8, micro_batch_size=8 * args.prompts_per_step,
                              max_completion_length=16,
                              seq_len=64, temperature=0.7, max_steps=args.steps, learning_rate=2e-4,
                              schedule="constant", lora_r=16, lora_alpha=32, seed=0)
    records: list[dict] = []
    jaxtune.train(model, tokenizer, additions(400, seed=0), cfg, out_dir=run, base_model=str(converted),
                  reward_funcs=["last_number"], callback=records.append)

    print("[4/4] the tuned model answers the same additions")
    right_after, after = accuracy(model, tokenizer, held_out)
    for i in range(min(3, len(held_out))):
        print(f"\n>>> {held_out[i]['prompt'][0]['content']}\nbefore: {before[i].strip()[:80]}\nafter:  {after[i].strip()[:80]}")
    third = max(len(records) // 3, 1)
    mean = lambda rs: sum(r["reward"] for r in rs) / len(rs)  # noqa: E731
    summary = {"steps": len(records), "reward_first_third": round(mean(records[:third]), 3),
               "reward_last_third": round(mean(records[-third:]), 3),
               "right_before": right_before, "right_after": right_after,
               "seconds": round(time.perf_counter() - start, 1), "device": jax.local_devices()[0].device_kind}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"\nmean reward {summary['reward_first_third']:.2f} (first third of the steps) -> "
          f"{summary['reward_last_third']:.2f} (last third); held-out sums right {right_before:.0%} -> "
          f"{right_after:.0%} ({summary['seconds']:.0f} s)")
    print(f"run directory: {run} (metrics.jsonl, completions.jsonl, loss.png)")


if __name__ == "__main__":
    main()
