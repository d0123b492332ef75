"""Preference tuning end to end on the bundled model: DPO teaches SmolLM2 a rule from pairs alone.

Pairs (examples/data/caps_train.jsonl, from make_preference_data.py) prefer an answer in CAPITAL LETTERS to the
same answer in normal case. Before and after DPO, the model answers held-out questions (caps_eval.jsonl) and the
behaviour score is the share of answers written in capitals; the held-out reward accuracy (how often the tuned
model prefers the chosen answer more than the reference does) comes from a held-out split of the pairs.

    python examples/dpo_demo.py [--steps 40] [--out runs/dpo-demo] [--eval-limit N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import jax

import jaxtune
from bundled_smollm2 import load_converted

DATA = Path(__file__).resolve().parent / "data"


def in_capitals(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    return len(letters) >= 3 and sum(c.isupper() for c in letters) >= 0.8 * len(letters)


def behaviour(model, tokenizer, questions: list[str]) -> tuple[float, list[str]]:
    """Share of greedy answers to `questions` written in capital letters."""
    outputs = jaxtune.generate(model, tokenizer, [[{"role": "user", "content": q}] for q in questions],
                               max_new_tokens=24)
    return sum(in_capitals(o) for o in outputs) / len(outputs), outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--objective", default="dpo", choices=["dpo", "orpo"])
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--out", default="runs/dpo-demo")
    ap.add_argument("--eval-limit", type=int, default=None, help="answer the first N held-out questions only")
    args = ap.parse_args()
    start = time.perf_counter()
    out = Path(args.out)
    model, tokenizer, converted = load_converted(out)
    questions = [json.loads(line)["prompt"] for line in (DATA / "caps_eval.jsonl").read_text().splitlines()]
    questions = questions[:args.eval_limit]

    print(f"[2/4] the base model answers {len(questions)} held-out questions")
    before, before_out = behaviour(model, tokenizer, questions)

    print(f"[3/4] {args.objective.upper()} for {args.steps} steps on preference pairs")
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)
    cfg = jaxtune.TrainConfig(objective=args.objective, beta=args.beta, seq_len=256, micro_batch_size=4,
                              max_steps=args.steps, learning_rate=args.lr, schedule="cosine", warmup_steps=2, lora_r=16,
                              lora_alpha=32, eval_fraction=0.1, eval_steps=args.steps // 4)  # 0: at the end only
    records: list[dict] = []
    result = jaxtune.train(model, tokenizer, DATA / "caps_train.jsonl", cfg, out_dir=run, base_model=str(converted),
                           callback=records.append)
    evals = [r for r in records if "eval_rewards/accuracies" in r]

    print("[4/4] the tuned model answers the same questions")
    after, after_out = behaviour(model, tokenizer, questions)
    for i in range(min(4, len(questions))):
        print(f"\n>>> {questions[i]}\nbefore: {before_out[i].strip()[:120]}\nafter:  {after_out[i].strip()[:120]}")
    summary = {"objective": args.objective, "capitals_before": before, "capitals_after": after,
               # at step 0 the policy is the reference: every reward is 0, no pair is ranked right
               "eval_reward_accuracy_before": 0.0,
               "eval_reward_accuracy_after": evals[-1]["eval_rewards/accuracies"] if evals else None,
               "eval_reward_margin_after": evals[-1]["eval_rewards/margins"] if evals else None,
               "steps": result.steps, "final_loss": round(result.losses[-1], 4),
               "seconds": round(time.perf_counter() - start, 1), "device": jax.local_devices()[0].device_kind}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"\nanswers in capitals on held-out questions: {before:.0%} before -> {after:.0%} after; held-out reward "
          f"accuracy {summary['eval_reward_accuracy_after']:.0%} ({result.steps} steps, {summary['seconds']:.0f} s)")
    print(f"run directory: {run} (metrics.jsonl with rewards/*, loss.png, checkpoints)")


if __name__ == "__main__":
    main()
