"""Unsloth + TRL DPOTrainer / ORPOTrainer (PEFT, ref_model=None) throughput and peak memory, on the pairs
benchmarks/steps/dpo_qlora.py gives jaxtune. Run with the baseline packages (../shared/bench: PYTHONPATH=$PWD/.site).

    python3 benchmarks/steps/unsloth_dpo.py /tmp/bnb4_llama3-8b dpo 2 unsloth [profile]
One JSON line: tok/s over both sequences of each pair (each cut to max_length=2048), the median step time after
two warm-up steps; peak = torch.cuda.max_memory_allocated. With `profile`, steps 4 and 5 also run under the torch
profiler and a second line gives their GPU time per step by kernel class (the classes of .bench/unsloth_profile.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import unsloth  # noqa: E402,F401  (before transformers)
from unsloth import FastLanguageModel, PatchDPOTrainer  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.steps.preference_pairs import random_pairs  # noqa: E402

PatchDPOTrainer()


def kernel_class(name: str) -> str:
    n = name.lower()
    if "dequant" in n or "kdequantize" in n:
        return "nf4 dequant"
    if "flash" in n or "fmha" in n or "attn" in n or "sdpa" in n:
        return "attention"
    if "gemm" in n or "sm90" in n or "cutlass" in n or "nvjet" in n or "matmul" in n:
        return "gemm"
    if "cross_entropy" in n or "logsumexp" in n or "log_softmax" in n or "softmax" in n:
        return "cross-entropy / log-probs"
    if "rms" in n or "layernorm" in n:
        return "rmsnorm"
    if "rope" in n or "rotary" in n:
        return "rope"
    if "swiglu" in n or "geglu" in n or "silu" in n:
        return "swiglu"
    if "adam" in n:
        return "optimizer"
    return "other"


class StepProfile(TrainerCallback):
    """torch profiler (CUDA activity) over steps `first` .. `first + count - 1`."""

    def __init__(self, first: int = 4, count: int = 2):
        self.first, self.count, self.prof = first, count, None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step + 1 == self.first:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if self.prof is not None and state.global_step == self.first + self.count - 1:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)

    def by_class(self) -> dict[str, float]:
        groups: dict[str, float] = {}
        for e in self.prof.key_averages():
            if e.device_type.name == "CUDA":
                c = kernel_class(e.key)
                groups[c] = groups.get(c, 0.0) + e.self_device_time_total / self.count / 1000
        return {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.t0 = [], None

    def on_step_begin(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    path, objective, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ckpt = {"false": False, "true": True}.get(sys.argv[4].lower(), sys.argv[4]) if len(sys.argv) > 4 else "unsloth"
    profiled = StepProfile() if len(sys.argv) > 5 and sys.argv[5] == "profile" else None
    steps, prompt, response, max_length = 8, 1024, 1536, 2048
    from datasets import Dataset

    model, tok = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=max_length, load_in_4bit=True,
                                                   dtype=torch.bfloat16)
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing=ckpt, random_state=0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    rows = Dataset.from_list(random_pairs(batch * (steps + 2), prompt, response, model.config.vocab_size))
    common = dict(output_dir="/tmp/unsloth_pref", per_device_train_batch_size=batch, max_steps=steps + 2,
                  learning_rate=5e-5, bf16=True, logging_steps=1, report_to=[], save_strategy="no",
                  max_length=max_length, lr_scheduler_type="constant", optim="adamw_torch_fused",
                  gradient_accumulation_steps=1)  # Unsloth's RL patch makes it 2 when left out
    times = StepTimes()
    callbacks = [times] + ([profiled] if profiled is not None else [])
    torch.cuda.reset_peak_memory_stats()
    if objective == "dpo":
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=model, ref_model=None, args=DPOConfig(beta=0.1, **common), train_dataset=rows,
                             processing_class=tok, callbacks=callbacks)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=model, args=ORPOConfig(beta=0.1, max_prompt_length=prompt, **common),
                              train_dataset=rows, processing_class=tok, callbacks=callbacks)
    res = {"system": "unsloth+trl", "objective": objective, "bs": batch, "grad_ckpt": str(ckpt),
           "tokens_per_step": batch * 2 * max_length}
    try:
        trainer.train()
        step_s = statistics.median(times.times[2:])
        res.update(step_s=round(step_s, 4), tok_s=round(batch * 2 * max_length / step_s),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   loss=[round(x["loss"], 4) for x in trainer.state.log_history if "loss" in x])
    except torch.OutOfMemoryError:
        res.update(error="OOM")
    print(json.dumps(res), flush=True)
    if profiled is not None and profiled.prof is not None and "error" not in res:
        classes = profiled.by_class()
        print(json.dumps({"system": "unsloth+trl", "objective": objective, "bs": batch, "profile": "gpu ms per step",
                          "total": round(sum(classes.values()), 1), **classes}), flush=True)


if __name__ == "__main__":
    main()
