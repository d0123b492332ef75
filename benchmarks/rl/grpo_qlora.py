"""jaxtune GRPO step time, rollout throughput and peak memory on a bnb-4bit checkpoint
(benchmarks/tools/make_bnb4_checkpoint.py), through `jaxtune.train` itself, on the prompts benchmarks/rl/unsloth_grpo.py
gives Unsloth + TRL.

    PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8,16x4 [--profile DIR] [--cap-gib 24] [--mesh data=2]
8 prompts of 256 words (one word is one token), 8 completions each, 512 tokens each with EOS never sampled (both
sides generate the same number of tokens), LoRA r=16 on the 7 projections, loss dapo, beta 0. A batch is
MICROxACCUM completions per optimizer step (64 = 8 prompts x 8). One JSON line per batch: the median over the
steps after the first two (compilation) of the step time and of its phases (rollout = sampling, the rest =
rewards + log-probabilities + update), generated tokens/s, and peak memory; `--decode` adds the rollout alone at
64 sequences against the memory-bandwidth bound (bytes one decode step reads / HBM bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.rl.grpo_prompts import random_prompts, random_reward  # noqa: E402

HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # SXM datasheet bandwidth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--batches", default="8x8", help="MICROxACCUM per optimizer step, comma-separated")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--compute", default="bf16")
    ap.add_argument("--profile", help="trace step 4 to this folder and print its GPU time by kernel class")
    ap.add_argument("--fused-rows", type=int, help="NF4 projections of up to this many rows (decoding) take the fused "
                                                   "kernel instead of dequantize + cuBLAS (the table's default: 16)")
    ap.add_argument("--dense-rollout", choices=("default", "auto", "on", "off"), default="default",
                    help="sample from the NF4 base dequantized once per rollout (auto: where it fits, with per-layer "
                         "caches) or from the 4-bit codes each token (default: the library's setting)")
    ap.add_argument("--nf4-table", help="benchmarks/kernels/nf4_matmul.py --out JSON: decoding's rows (up to 64) take the "
                                        "fused kernel with the fastest tile per weight shape")
    ap.add_argument("--cap-gib", type=float, help="use only this much GPU memory (a card of that size)")
    ap.add_argument("--mesh", help="device mesh, e.g. data=2 (default: one device)")
    ap.add_argument("--per-layer-cache", choices=("auto", "on", "off"), default="auto",
                    help="decode with a KV cache per layer, one traced layer each (auto: on a GPU), or the layer loop")
    args = ap.parse_args()
    import importlib

    decoding = importlib.import_module("jaxtune.generate")  # the package exports a function of that name
    decoding.PER_LAYER_CACHE = {"auto": None, "on": True, "off": False}[args.per_layer_cache]
    if args.cap_gib:
        from benchmarks.ladders.context_ladder import cap_device_memory

        cap_device_memory(args.cap_gib)
    if args.fused_rows:
        from jaxtune.ops import dispatch

        dispatch.NF4_TABLE = ((args.fused_rows, "fused"), (float("inf"), "dequant+dot"))
    if args.nf4_table:
        from benchmarks.rl.decode_profile import use_fused_tiles

        use_fused_tiles(args.nf4_table)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxtune
    from jaxtune.rl.source import Rollouts

    Rollouts.ignore_eos = True
    from jaxtune.rl import rollout

    if args.dense_rollout != "default":
        rollout.DENSE_ROLLOUT = {"auto": None, "on": True, "off": False}[args.dense_rollout]
    chosen: dict = {}
    plan = Rollouts._plan_sampling

    def recorded_plan(self, *a):  # what the planner chose: the dense copy, rows per sampling call
        rows = plan(self, *a)
        chosen.update(dense_rollout=self.dense, rows_per_call=rows)
        return rows

    Rollouts._plan_sampling = recorded_plan
    model, tokenizer = jaxtune.from_pretrained(args.model, load_in_4bit=True)
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    fresh = jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))
    kind = jax.local_devices()[0].device_kind
    for spec in args.batches.split(","):
        micro, accum = (int(x) for x in spec.split("x"))
        prompts_per_step = micro * accum // args.generations
        nnx.update(model, jax.tree.map(jnp.copy, fresh))
        rows = random_prompts(prompts_per_step * (args.steps + 2), args.prompt, model.config.vocab_size)
        prompt_tokens = len(tokenizer(rows[0]["prompt"])["input_ids"])  # the words, and BOS if the tokenizer adds it
        cfg = jaxtune.TrainConfig(objective="grpo", num_generations=args.generations, micro_batch_size=micro,
                                  grad_accum=accum, max_completion_length=args.completion,
                                  seq_len=prompt_tokens + args.completion, max_steps=args.steps, learning_rate=5e-6,
                                  lora_r=16, lora_alpha=16, compute=args.compute, temperature=1.0,
                                  mesh=args.mesh)
        records, times = [], []
        trace = f"{args.profile}/{spec}" if args.profile else None
        t = [time.perf_counter()]

        def on_step(record, records=records, times=times, trace=trace):
            now = time.perf_counter()
            times.append(now - t[0])
            t[0] = now
            records.append(record)
            if trace and record["step"] == 3:
                jax.profiler.start_trace(trace, create_perfetto_trace=True)
            elif trace and record["step"] == 4:
                jax.profiler.stop_trace()

        try:
            jaxtune.train(model, tokenizer, rows, cfg, progress=False, callback=on_step,
                          reward_funcs=[random_reward])
        except jaxtune.JaxtuneError as e:
            print(json.dumps({"system": "jaxtune", "batch": spec, "error": str(e).splitlines()[0][:200]}), flush=True)
            continue
        steady = list(zip(records, times))[2:]
        step_s = statistics.median(s for _, s in steady)
        rollout_s = statistics.median(r["rollout_seconds"] for r, _ in steady)
        generated = micro * accum * args.completion
        print(json.dumps({
            "system": "jaxtune", "device": kind, "batch": spec, "completions_per_step": micro * accum,
            "cap_gib": args.cap_gib, "mesh": args.mesh, "devices": jax.device_count(),
            "fused_rows": args.fused_rows or 16,
            "per_layer_cache": decoding.per_layer_cache(jax.default_backend() == "gpu"), **chosen,
            "step_s": round(step_s, 3), "rollout_s": round(rollout_s, 3),
            "rest_s": round(step_s - rollout_s, 3), "generated_tok_s": round(generated / rollout_s),
            "step_completion_tok_s": round(generated / step_s),
            "mean_length": records[-1]["completions/mean_length"],
            "peak_gib": max(r.get("peak_memory_gib", 0) for r in records),
            "loss": [round(r["loss"], 5) for r in records]}), flush=True)
        if trace:
            from benchmarks.tools.trace_summary import summarize

            print(json.dumps({"system": "jaxtune", "batch": spec, "profile": "gpu ms per step",
                              **summarize(trace, 1)}), flush=True)
    bound = decode_bound(model, 64, args.prompt + args.completion, kind)
    print(json.dumps({"system": "jaxtune", "device": kind, "decode_bound": bound}), flush=True)


def decode_bound(model, sequences: int, context: int, kind: str) -> dict:
    """What one decode step of `sequences` rows must read at the mean context length (half of `context`): every
    weight once (NF4 codes + their scales; bf16 norms, LoRA, embedding row gathers aside, the head in bf16) and
    each row's KV cache; divided by the card's HBM bandwidth, the fastest a step can be."""
    import jax
    from flax import nnx

    c = model.config
    frozen = nnx.state(model, nnx.Not(nnx.LoRAParam))
    weight_bytes = sum(x.nbytes for path, x in nnx.to_flat_state(frozen) if "embed" not in str(path))
    kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * (context // 2) * sequences
    lora_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))
    total = weight_bytes + kv_bytes + lora_bytes
    bw = next((v for k, v in HBM_BYTES_PER_S.items() if k in kind), 3.35e12)
    step_s = total / bw
    return {"bytes_per_step": total, "weights": weight_bytes, "kv_cache": kv_bytes, "hbm_bytes_per_s": bw,
            "min_step_ms": round(step_s * 1e3, 3), "max_tok_s": round(sequences / step_s)}


if __name__ == "__main__":
    main()
