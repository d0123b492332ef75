"""What quantization-aware training recovers of a 4-bit export's loss, on the bundled SmolLM2-135M-Instruct and the
demo's task (examples/data/people_*.jsonl: answer in a fixed JSON schema; held-out names).

    PYTHONPATH=.:examples python benchmarks/accuracy/qat_smollm2.py [--steps 12] [--out runs/qat] [--formats q4_0,q4_k,nf4]
        [--ptq-formats q4_k_m] [--base nf4|gguf]
For each run (plain LoRA, then QAT per format), the same data, steps and seed: the held-out loss on the answers and
the exact match of greedy answers, of (a) the fine-tune in memory, (b) its 4-bit export, read back as a user runs it
(q4_0: the GGUF file through jaxtune's GGUF loader; nf4: the merged bitsandbytes checkpoint through jaxtune's
loader). The adapters merge onto the NF4 base the run trained (the weights QAT simulates). One JSON line per
(run, model); the last line has the recovered fraction (PTQ - QAT) / (PTQ - unquantized) of the held-out loss.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxtune
from bundled_smollm2 import load_converted
from demo import DATA, exact_match


def answer_loss(model, tokenizer, evals: list[dict]) -> float:
    """Mean negative log-likelihood of the held-out answers' tokens after their chat prompts (all rows in one
    right-padded batch: one compilation; a causal model's logits do not see the padding after them)."""
    rows, starts = [], []
    for e in evals:
        chat = [{"role": "user", "content": e["prompt"]}]
        prompt = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": e["answer"]}], tokenize=False)
        rows.append(tokenizer(full, add_special_tokens=False)["input_ids"])
        starts.append(len(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(model(ids), jnp.float32), axis=-1))
    total, count = 0.0, 0
    for i, r in enumerate(rows):
        targets = np.asarray(r[starts[i]:])
        total -= float(logp[i, np.arange(starts[i] - 1, len(r) - 1), targets].sum())
        count += len(targets)
    return total / count


EXPORT = {"q4_k": "q4_k_m"}  # the GGUF type a QAT format's run is exported in (q4_K QAT for a Q4_K_M file)


def compare(load, train_data: Path, evals: list[dict], train_config: dict, formats: list[str],
            ptq_formats: list[str], out: Path, qat_start_step: int = 0) -> dict[tuple[str, str], float]:
    """The plain fine-tune and one QAT fine-tune per format from `load()`'s (model, tokenizer), each exported and read
    back as a user runs it; prints a JSON line per (run, model) and the recovered fraction per format."""
    losses: dict[tuple[str, str], float] = {}
    load_dtype = "float32" if jax.local_devices()[0].platform == "cpu" else "bfloat16"

    def score(run: str, what: str, model, tokenizer) -> None:
        loss = answer_loss(model, tokenizer, evals)
        match, _ = exact_match(model, tokenizer, evals)
        losses[(run, what)] = loss
        print(json.dumps({"run": run, "model": what, "held_out_loss": round(loss, 4), "exact_match": match,
                          "device": jax.local_devices()[0].device_kind}), flush=True)

    for qat in ["none", *formats]:
        model, tokenizer = load()
        cfg = jaxtune.TrainConfig(**train_config, qat=qat, qat_start_step=qat_start_step if qat != "none" else 0)
        t0 = time.perf_counter()
        result = jaxtune.train(model, tokenizer, train_data, cfg, progress=False)
        print(json.dumps({"run": qat, "train_s": round(time.perf_counter() - t0, 1),
                          "final_loss": round(result.losses[-1], 4),
                          "loss_every_10": [round(v, 3) for v in result.losses[::10]]}), flush=True)
        if qat == "none":
            score(qat, "in memory", model, tokenizer)
        exports = [EXPORT.get(qat, qat)] if qat != "none" else [*(EXPORT.get(f, f) for f in formats), *ptq_formats]
        for fmt in exports:
            exported = out / f"{qat}-{fmt}"
            shutil.rmtree(exported, ignore_errors=True)
            exported.mkdir(parents=True)
            import warnings

            with warnings.catch_warnings():  # merging onto the dequantized NF4 base, on purpose (see the docstring)
                warnings.simplefilter("ignore")
                if fmt != "nf4":
                    jaxtune.save_gguf(model, exported / "model.gguf", tokenizer=tokenizer, gguf_type=fmt)
                    print(json.dumps({"run": qat, "export": fmt, "gguf_bytes": (exported / "model.gguf").stat().st_size}),
                          flush=True)
                    deployed, deployed_tok = jaxtune.from_pretrained(exported / "model.gguf", dtype=load_dtype)
                else:
                    jaxtune.save_merged(model, exported / "merged", tokenizer=tokenizer, dtype="nf4")
                    deployed, deployed_tok = jaxtune.from_pretrained(exported / "merged", dtype=load_dtype)
            score(qat, f"{fmt} export", deployed, deployed_tok)
            shutil.rmtree(exported, ignore_errors=True)
    for fmt in formats:
        export = EXPORT.get(fmt, fmt)
        full, ptq, qat = (losses[("none", "in memory")], losses[("none", f"{export} export")],
                          losses[(fmt, f"{export} export")])
        print(json.dumps({"format": fmt, "unquantized": round(full, 4), "ptq": round(ptq, 4), "qat": round(qat, 4),
                          "recovered": round((ptq - qat) / (ptq - full), 3) if ptq != full else None}), flush=True)
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="runs/qat")
    ap.add_argument("--formats", default="q4_0,nf4", help="QAT runs, each exported in its own format")
    ap.add_argument("--ptq-formats", default="", help="more GGUF types the plain fine-tune is exported in (q4_k_m)")
    ap.add_argument("--eval-limit", type=int, default=None)
    ap.add_argument("--base", default="nf4", choices=["nf4", "gguf"],
                    help="train on the NF4 conversion (as `make demo`), or on the bundled GGUF's own weights in "
                         "float32 (load_in_4bit=False: the merge is not on NF4's grid)")
    args = ap.parse_args()
    out = Path(args.out)
    evals = [json.loads(line) for line in (DATA / "people_eval.jsonl").read_text().splitlines()][:args.eval_limit]

    def load():
        if args.base == "nf4":
            return load_converted(out)[:2]
        return jaxtune.from_pretrained("smollm2", dtype="float32", load_in_4bit=False)

    train_config = dict(format="chat", seq_len=192, micro_batch_size=4, max_steps=args.steps, learning_rate=1e-3,
                        schedule="cosine", warmup_steps=3, lora_r=16, lora_alpha=32)
    compare(load, DATA / "people_train.jsonl", evals, train_config, [f for f in args.formats.split(",") if f],
            [f for f in args.ptq_formats.split(",") if f], out)


if __name__ == "__main__":
    main()
