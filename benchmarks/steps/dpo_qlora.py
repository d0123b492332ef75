"""jaxtune DPO / ORPO throughput and peak memory on a bnb-4bit checkpoint (benchmarks/tools/make_bnb4_checkpoint.py),
through `jaxtune.train` itself, on the random pairs benchmarks/steps/unsloth_dpo.py gives Unsloth + TRL.

    PYTHONPATH=. python3 benchmarks/steps/dpo_qlora.py /tmp/bnb4_llama3-8b --objective dpo --batches 1,2,4
A pair is prompt (1,024 tokens) + chosen and prompt + rejected, each sequence cut to 2,048 tokens as TRL's
max_length=2048 does. jaxtune runs the prompt once by default (a row of 1,024 + 2 x 1,024 = 3,072 tokens, the
responses cut to what TRL keeps, one token less for the prompt's last token that both responses start from);
`--no-share-prompt` runs it twice (seq_len 4,096 holds the two sequences). One JSON line per configuration; tok/s
counts both sequences' tokens as TRL processes them (2 x 2,048 per pair) whatever the layout, the median of the
steps after the first two (compilation); row_tok_s counts the tokens jaxtune's rows hold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.steps.preference_pairs import random_pairs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--objective", default="dpo", choices=["dpo", "orpo"])
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--response", type=int, default=1536)
    ap.add_argument("--max-length", type=int, default=2048, help="per sequence, as TRL's max_length")
    ap.add_argument("--compute", default="bf16")
    ap.add_argument("--remat", default="auto")
    ap.add_argument("--no-share-prompt", action="store_true", help="run each prompt twice, once per response")
    ap.add_argument("--profile", help="trace steps 4 and 5 of each batch to this folder and print their GPU time per "
                                      "step by kernel class (benchmarks/tools/trace_summary.py)")
    args = ap.parse_args()
    share = not args.no_share_prompt
    kept = args.max_length - args.prompt  # response tokens TRL keeps of each sequence
    seq_len = args.prompt + 2 * kept if share else 2 * args.max_length

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxtune

    model, tokenizer = jaxtune.from_pretrained(args.model, load_in_4bit=True)
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    fresh = jax.tree.map(jnp.copy, nnx.state(model, nnx.LoRAParam))
    for batch in (int(b) for b in args.batches.split(",")):
        nnx.update(model, jax.tree.map(jnp.copy, fresh))
        rows = random_pairs(batch * (args.steps + 2), args.prompt, min(args.response, kept), model.config.vocab_size)
        cfg = jaxtune.TrainConfig(objective=args.objective, seq_len=seq_len, micro_batch_size=batch,
                                  max_steps=args.steps + 2, learning_rate=5e-5, lora_r=16, lora_alpha=16,
                                  compute=args.compute, remat=args.remat, packing=False, share_prompt=share)
        records = []
        trace = f"{args.profile}/bs{batch}" if args.profile else None

        def on_step(record, records=records, trace=trace):
            records.append(record)
            if trace and record["step"] == 3:  # traced: steps 4 and 5
                jax.profiler.start_trace(trace, create_perfetto_trace=True)
            elif trace and record["step"] == 5:
                jax.profiler.stop_trace()

        try:
            result = jaxtune.train(model, tokenizer, rows, cfg, progress=False, callback=on_step)
        except jaxtune.JaxtuneError as e:  # the batch does not fit: recorded as a result, the next batch still runs
            print(json.dumps({"system": "jaxtune", "objective": args.objective, "bs": batch, "compute": args.compute,
                              "error": "OOM" if "memory" in str(e) else str(e).splitlines()[0]}), flush=True)
            continue
        if result.micro_batch_size != batch:  # stepped down after running out of memory mid-run
            print(json.dumps({"system": "jaxtune", "objective": args.objective, "bs": batch, "compute": args.compute,
                              "error": f"OOM (stepped down to {result.micro_batch_size})"}), flush=True)
            continue
        steady = records[2:]
        row_tok_s = statistics.median(r["tokens_per_s"] for r in steady)
        print(json.dumps({
            "system": "jaxtune", "objective": args.objective, "bs": batch, "compute": args.compute,
            "remat": result.remat, "share_prompt": share, "seq_len": seq_len,
            "tokens_per_step": batch * 2 * args.max_length,
            "tok_s": round(row_tok_s * 2 * args.max_length / seq_len), "row_tok_s": round(row_tok_s),
            "peak_gib": max(r.get("peak_memory_gib", 0) for r in records),
            "loss": [round(r["loss"], 4) for r in records],
            "rewards_margins": round(records[-1]["rewards/margins"], 4)}), flush=True)
        if trace:
            from benchmarks.tools.trace_summary import summarize

            print(json.dumps({"system": "jaxtune", "objective": args.objective, "bs": batch, "compute": args.compute,
                              "profile": "gpu ms per step", **summarize(trace, 2)}), flush=True)


if __name__ == "__main__":
    main()
