"""Decoding speed of a random Llama-3-8B-shaped QLoRA model (NF4 weights + LoRA adapters on all projections).

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/steps/generate_llama8b.py [--batch 1] [--prompt 128] [--new 128] [--profile DIR]
Prints one JSON line: prefill time, decode ms per token (greedy, no EOS: every row runs all --new tokens),
tokens/s, peak GiB; with --profile, GPU time per decoded token by op class (trace of one more run).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import jaxtune
from benchmarks.ladders.scale_qlora import MODELS, random_model
from jaxtune.parallel.distributed import peak_memory_gib
from jaxtune.generate import generate_tokens
from jaxtune.parallel.sharding import make_mesh


def timed_generate(model, prompts: list[list[int]], new: int) -> float:
    """Seconds for one generate_tokens call (already compiled for these shapes)."""
    t0 = time.perf_counter()
    out = generate_tokens(model, prompts, max_new_tokens=new)
    assert all(len(row) == new for row in out), "a row stopped early: the benchmark decodes without EOS"
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=128, help="decoded tokens per row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", help="trace one more run to this folder and print GPU time by op class")
    args = ap.parse_args()

    model = random_model(args.model, make_mesh(None, jax.devices()[:1]))
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, model.config.vocab_size, (args.batch, args.prompt)).tolist()

    generate_tokens(model, prompts, max_new_tokens=1)  # compiles the prefill alone
    t0 = time.perf_counter()
    generate_tokens(model, prompts, max_new_tokens=args.new)  # and prefill + decode
    first_call_s = time.perf_counter() - t0
    prefill_s = min(timed_generate(model, prompts, 1) for _ in range(args.repeats))
    total_s = min(timed_generate(model, prompts, args.new) for _ in range(args.repeats))
    decode_ms = (total_s - prefill_s) / (args.new - 1) * 1e3
    print(json.dumps({
        "system": "jaxtune", "device": jax.devices()[0].device_kind, "model": args.model, "batch": args.batch,
        "prompt": args.prompt, "new": args.new, "prefill_s": round(prefill_s, 4), "total_s": round(total_s, 4),
        "decode_ms_per_token": round(decode_ms, 3), "decode_tok_s": round(args.batch * 1e3 / decode_ms, 1),
        "first_call_s": round(first_call_s, 1), "peak_gib": round(peak_memory_gib() or 0.0, 2),
    }), flush=True)
    if args.profile:
        from benchmarks.tools.trace_summary import main as summarize

        jax.profiler.start_trace(args.profile)
        timed_generate(model, prompts, args.new)
        jax.profiler.stop_trace()
        summarize(args.profile, steps=args.new, top=15)


if __name__ == "__main__":
    main()
