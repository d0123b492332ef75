"""Variable-length QLoRA throughput of the baselines (HF transformers + PEFT + bitsandbytes, Unsloth) on the
workload of benchmarks/steps/varlen.py, for the end-to-end benchmark. Run on the GPU machine with the baseline
packages on PYTHONPATH (benchmarks/README.md says how):
    python3 benchmarks/steps/baselines_varlen.py hf /tmp/base_llama3-8b
    python3 benchmarks/steps/baselines_varlen.py unsloth /tmp/base_llama3-8b
One JSON line per configuration: real (non-pad) tokens/s and peak GiB.
- hf: batches of 8 samples padded to their longest (the default padding collator), gradient checkpointing on.
- unsloth padded: the same batches, Unsloth's default "unsloth" offloaded checkpointing.
- unsloth rows: samples concatenated into 2048-token rows with no boundary masking (the old TRL packing=True;
  cross-sample attention, so an upper bound on speed rather than the same training).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")

from benchmarks.steps.varlen import sample_sequences  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB, BATCH, ROW = 128256, 8, 2048


def padded_batches(torch, seqs, bs):
    out = []
    for i in range(0, len(seqs) - bs + 1, bs):
        chunk = seqs[i:i + bs]
        width = max(len(s) for s in chunk)
        ids = torch.zeros((bs, width), dtype=torch.long)
        mask = torch.zeros((bs, width), dtype=torch.long)
        for j, s in enumerate(chunk):
            ids[j, :len(s)] = torch.from_numpy(s.astype("int64"))
            mask[j, :len(s)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids.cuda(), mask.cuda(), labels.cuda(), int(mask.sum())))
    return out


def row_batches(torch, seqs, bs):
    import numpy as np

    flat = np.concatenate(seqs)
    rows = flat[: (len(flat) // ROW) * ROW].reshape(-1, ROW)
    out = []
    for i in range(0, len(rows) - bs + 1, bs):
        ids = torch.from_numpy(rows[i:i + bs].astype("int64")).cuda()
        out.append((ids, None, ids, ids.numel()))
    return out


def timed(torch, model, opt, batches, warm=3):
    for i, (ids, mask, labels, _) in enumerate(batches):
        if i == warm:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    real = sum(b[3] for b in batches[warm:])
    slots = sum(b[0].numel() for b in batches[warm:])
    return {"tok_s": round(real / dt), "slot_efficiency": round(real / slots, 4), "steps": len(batches) - warm,
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss": float(loss)}


def run(system: str, path: str) -> None:
    if system == "unsloth":
        importlib.import_module("unsloth")  # it patches transformers, so it loads first
    import torch

    seqs = sample_sequences(3 + 12 * BATCH + 400, VOCAB)
    if system == "hf":
        from peft import LoraConfig, get_peft_model
        from transformers import BitsAndBytesConfig, LlamaForCausalLM

        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                 device_map={"": 0}, quantization_config=q)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                                 task_type="CAUSAL_LM", target_modules=TARGETS))
        plans = [("padded", padded_batches(torch, seqs[: (3 + 12) * BATCH], BATCH))]
    else:
        from unsloth import FastLanguageModel

        model, _ = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=ROW, load_in_4bit=True,
                                                     dtype=torch.bfloat16)
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                                 target_modules=TARGETS, use_gradient_checkpointing="unsloth",
                                                 random_state=0)
        plans = [("padded", padded_batches(torch, seqs[: (3 + 12) * BATCH], BATCH)),
                 ("rows-unmasked", row_batches(torch, seqs, 4)[:15])]
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    for name, batches in plans:
        torch.cuda.reset_peak_memory_stats()
        res = {"system": system, "data": "varlen", "layout": name, "bs": batches[0][0].shape[0]}
        try:
            res.update(timed(torch, model, opt, batches))
        except torch.OutOfMemoryError:
            res["error"] = "OOM"
        print(json.dumps(res), flush=True)
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/tmp/base_llama3-8b")
