"""Unsloth + TRL GRPOTrainer (PEFT, fast_inference=False: vLLM is not installed on the benchmark machine, so TRL
samples with Unsloth's patched transformers generate) step time, generation time and peak memory on the prompts
benchmarks/rl/grpo_qlora.py gives jaxtune. Run with the baseline packages (../shared/bench: PYTHONPATH=$PWD/.site).

    python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b MICRO ACCUM [GRAD_CKPT] [profile]
8 completions of each prompt, generation batch MICRO x ACCUM completions (TRL's steps_per_generation = ACCUM),
one optimizer step per generation batch; 256-token prompts, 512-token completions (min_new_tokens: EOS never ends
one early), LoRA r=16 on the 7 projections, loss dapo, beta 0. One JSON line: the median over the steps after the
first (warm-up) of the step time and of its generation phase, generated tokens/s, peak memory
(torch.cuda.max_memory_allocated). With `profile`, step 3 runs under the torch profiler and a second line gives its
GPU time by kernel class.
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
import unsloth  # noqa: E402,F401  (before transformers and trl)
from unsloth import FastLanguageModel  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks.rl.grpo_prompts import random_prompts, random_reward  # noqa: E402
from benchmarks.steps.unsloth_dpo import StepProfile, StepTimes  # noqa: E402


class GenerationTimer:
    """Wraps the trainer's generation call, timing each (CUDA synchronized)."""

    def __init__(self, trainer, name: str):
        self.times, inner = [], getattr(trainer, name)

        def timed(*a, **k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = inner(*a, **k)
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - t0)
            return out

        setattr(trainer, name, timed)


def main() -> None:
    path, micro, accum = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ckpt = {"false": False, "true": True}.get(sys.argv[4].lower(), sys.argv[4]) if len(sys.argv) > 4 else "unsloth"
    profiled = StepProfile(first=3, count=1) if len(sys.argv) > 5 and sys.argv[5] == "profile" else None
    steps, prompt, completion, g = 3, 256, 512, 8
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tok = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=prompt + completion + 8,
                                                   load_in_4bit=True, dtype=torch.bfloat16, fast_inference=False)
    model = FastLanguageModel.get_peft_model(
        model, r=16, lora_alpha=16, lora_dropout=0, bias="none", use_gradient_checkpointing=ckpt, random_state=0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    per_step = micro * accum // g
    rows = Dataset.from_list(random_prompts(per_step * (steps + 1), prompt, model.config.vocab_size))
    args = GRPOConfig(output_dir="/tmp/unsloth_grpo", per_device_train_batch_size=micro,
                      gradient_accumulation_steps=accum, steps_per_generation=accum, num_generations=g,
                      max_completion_length=completion, temperature=1.0, learning_rate=5e-6, beta=0.0,
                      loss_type="dapo", max_steps=steps, logging_steps=1, report_to=[], save_strategy="no",
                      bf16=True, lr_scheduler_type="constant", optim="adamw_torch_fused",
                      generation_kwargs={"min_new_tokens": completion})
    times = StepTimes()
    callbacks = [times] + ([profiled] if profiled is not None else [])
    trainer = GRPOTrainer(model=model, reward_funcs=[random_reward], args=args, train_dataset=rows,
                          processing_class=tok, callbacks=callbacks)
    generation = GenerationTimer(trainer, "_generate")
    torch.cuda.reset_peak_memory_stats()
    res = {"system": "unsloth+trl", "device": torch.cuda.get_device_name(), "batch": f"{micro}x{accum}",
           "grad_ckpt": str(ckpt), "completions_per_step": micro * accum}
    try:
        trainer.train()
        step_s, gen_s = statistics.median(times.times[1:]), statistics.median(generation.times[1:])
        lengths = [x.get("completions/mean_length") for x in trainer.state.log_history if "completions/mean_length" in x]
        generated = micro * accum * completion
        res.update(step_s=round(step_s, 3), rollout_s=round(gen_s, 3), rest_s=round(step_s - gen_s, 3),
                   generated_tok_s=round(generated / gen_s), step_completion_tok_s=round(generated / step_s),
                   mean_length=lengths[-1] if lengths else None,
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   loss=[round(x["loss"], 5) for x in trainer.state.log_history if "loss" in x])
    except torch.OutOfMemoryError:
        res.update(error="OOM")
    print(json.dumps(res), flush=True)
    if profiled is not None and profiled.prof is not None and "error" not in res:
        classes = profiled.by_class()
        print(json.dumps({"system": "unsloth+trl", "batch": f"{micro}x{accum}", "profile": "gpu ms per step",
                          "total": round(sum(classes.values()), 1), **classes}), flush=True)


if __name__ == "__main__":
    main()
