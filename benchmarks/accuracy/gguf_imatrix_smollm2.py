"""What an importance matrix from the fine-tuning data recovers of a 4-bit GGUF's loss, on the bundled
SmolLM2-135M-Instruct and the demo's task (examples/data/people_*.jsonl: answer in a fixed JSON schema; held-out
names).

    PYTHONPATH=.:examples python benchmarks/accuracy/gguf_imatrix_smollm2.py [--steps 12] [--formats q4_0,q4_k_m]

One fine-tune (LoRA on the bundled model's own weights in float32, as `qat_smollm2.py --base gguf`), then each GGUF
type exported twice from it: plain, and with the importance matrix jaxtune computes by running the tuned model over
the training rows (`export --gguf-imatrix people_train.jsonl`). Each file is read back through jaxtune's GGUF
loader and scored on the 24 held-out prompts (mean loss of the answer tokens, exact match of greedy answers). One
JSON line per model; the last lines give the recovered fraction (plain - imatrix) / (plain - unquantized).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import jax

import jaxtune
from convert.imatrix import importance_from
from demo import DATA, exact_match
from qat_smollm2 import answer_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--formats", default="q4_0,q4_k_m")
    args = ap.parse_args()
    evals = [json.loads(line) for line in (DATA / "people_eval.jsonl").read_text().splitlines()]
    device = jax.local_devices()[0].device_kind
    losses: dict[str, float] = {}

    def score(what: str, model, tokenizer) -> None:
        losses[what] = answer_loss(model, tokenizer, evals)
        match, _ = exact_match(model, tokenizer, evals)
        print(json.dumps({"model": what, "held_out_loss": round(losses[what], 4), "exact_match": match,
                          "device": device}), flush=True)

    model, tokenizer = jaxtune.from_pretrained("smollm2", dtype="float32", load_in_4bit=False)
    cfg = jaxtune.TrainConfig(format="chat", seq_len=192, micro_batch_size=4, max_steps=args.steps, learning_rate=1e-3,
                              schedule="cosine", warmup_steps=3, lora_r=16, lora_alpha=32)
    result = jaxtune.train(model, tokenizer, DATA / "people_train.jsonl", cfg, progress=False)
    print(json.dumps({"final_loss": round(result.losses[-1], 4)}), flush=True)
    score("in memory", model, tokenizer)
    t0 = time.perf_counter()
    imatrix = importance_from(model, tokenizer, DATA / "people_train.jsonl", fmt="chat", seq_len=192, progress=False)
    print(json.dumps({"imatrix_s": round(time.perf_counter() - t0, 1), "tensors": len(imatrix.sums),
                      "tokens": next(iter(imatrix.counts.values()))}), flush=True)
    formats = [f for f in args.formats.split(",") if f]
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in formats:
            for weighted in (False, True):
                path = Path(tmp) / f"{fmt}-{weighted}.gguf"
                with warnings.catch_warnings():  # the adapters merge onto the float32 weights the run trained
                    warnings.simplefilter("ignore")
                    jaxtune.save_gguf(model, path, tokenizer=tokenizer, gguf_type=fmt,
                                      imatrix=imatrix if weighted else None)
                deployed, deployed_tok = jaxtune.from_pretrained(path, dtype="float32")
                score(f"{fmt}{' + imatrix' if weighted else ''}", deployed, deployed_tok)
                path.unlink()
    for fmt in formats:
        full, plain, weighted = losses["in memory"], losses[fmt], losses[f"{fmt} + imatrix"]
        print(json.dumps({"format": fmt, "unquantized": round(full, 4), "plain": round(plain, 4),
                          "imatrix": round(weighted, 4),
                          "recovered": round((plain - weighted) / (plain - full), 3) if plain != full else None}),
              flush=True)


if __name__ == "__main__":
    main()
