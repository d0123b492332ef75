"""A rollout of completions of varying length: static calls (each decodes to its longest completion) against
continuous batching (`jaxtune.rl.continuous`: slots refilled as completions end), the same slots, prompts and keys.

    PYTHONPATH=. python3 benchmarks/rl/continuous_rollout.py /tmp/bnb4_8b --completions 256 --slots 64
Lengths vary as in GRPO: every token of `--eos-fraction` of the vocabulary ends a completion (a random model's
near-uniform next token then ends one with that probability per step: geometric lengths, capped at --completion).
One JSON line per mode: seconds, generated tokens, tokens/s, decoding steps, prefills, and the step's bytes and the
fraction of the memory-bandwidth bound where the device's bandwidth is known.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # decode_profile's trace readers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--completions", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--eos-fraction", type=float, default=0.01)
    ap.add_argument("--dense", action="store_true", help="decode from the base dequantized once per rollout")
    ap.add_argument("--trace", help="profile each mode's timed run into this folder: GPU busy time, kernels per "
                                    "decoding step and the top kernels (GPU only)")
    args = ap.parse_args()

    import jax
    import numpy as np
    from flax import nnx

    import jaxtune
    from jaxtune.generate import cache_length, per_layer_cache, prompt_bucket
    from jaxtune.rl import decode_bound
    from jaxtune.rl.rollout import sample_rollout

    model, _ = jaxtune.from_pretrained(args.model, load_in_4bit=True)
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(10, vocab, args.prompt))) for _ in range(args.completions)]
    eos = tuple(int(t) for t in rng.choice(vocab, max(1, int(args.eos_fraction * vocab)), replace=False))
    per_layer = per_layer_cache(jax.default_backend() == "gpu")
    options = dict(max_new_tokens=args.completion, temperature=1.0, top_p=1.0, top_k=0, eos_ids=eos, pad_id=0,
                   rows_per_call=args.slots, dense=args.dense)
    bandwidth = decode_bound.memory_bandwidth()
    fraction = 1.0 if args.dense else 0.0
    step_bytes = decode_bound.step_bytes(frozen, lora, model.config, model.dtype, args.slots,
                                         cache_length(prompt_bucket(args.prompt), args.completion), per_layer,
                                         fraction)
    for continuous in (False, True):
        run = lambda: sample_rollout(graphdef, lora, frozen, prompts, jax.random.key(0),  # noqa: E731
                                     continuous=continuous, **options)
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
        mode = "continuous" if continuous else "static"
        if args.trace:
            jax.profiler.start_trace(f"{args.trace}/{mode}", create_perfetto_trace=True)
        t0 = time.perf_counter()
        out, stats = run()
        seconds = time.perf_counter() - t0
        if args.trace:
            jax.profiler.stop_trace()
        tokens = int((out >= 0).sum())
        lengths = (out >= 0).sum(axis=1)
        line = {"mode": mode, "device": jax.devices()[0].device_kind,
                "completions": args.completions, "slots": args.slots, "prompt": args.prompt,
                "max_completion": args.completion, "dense": args.dense, "seconds": round(seconds, 3),
                "first_call_s": round(first, 1), "generated_tokens": tokens,
                "mean_length": round(float(lengths.mean()), 1), "max_length": int(lengths.max()),
                "tokens_per_second": round(tokens / seconds, 1), "decode_steps": stats.steps,
                "prefills": stats.prefills, "step_bytes": step_bytes}
        if bandwidth:
            line["hbm_bound_fraction"] = round(decode_bound.bound_seconds(stats.steps, step_bytes, bandwidth)
                                               / seconds, 4)
        print(json.dumps(line), flush=True)
        if args.trace:
            print(json.dumps({"mode": mode, **kernel_summary(f"{args.trace}/{mode}", stats.steps)}), flush=True)


def kernel_summary(folder: str, steps: int) -> dict:
    """GPU busy milliseconds, kernel launches and the top kernels of a profiled run, per decoding step."""
    import collections

    from benchmarks.tools.trace_summary import _gpu_events, classify
    from decode_profile import busy_ms

    events = [e for e in _gpu_events(folder)[1] if "dur" in e and "ts" in e]
    ms, by_class = collections.Counter(), collections.Counter()
    for e in events:
        ms[e.get("name", "")[:100]] += float(e["dur"]) / 1e3
        by_class[classify(e.get("name", ""))] += float(e["dur"]) / 1e3
    return {"gpu_busy_ms_per_step": round(busy_ms(events) / steps, 3),
            "kernels_per_step": round(len(events) / steps, 1),
            "class_ms_per_step": {k: round(v / steps, 3) for k, v in by_class.most_common()},
            "top_kernels_ms_per_step": {k: round(v / steps, 3) for k, v in ms.most_common(15)}}


if __name__ == "__main__":
    main()
