"""Unsloth's QLoRA step on a mixture-of-experts or hybrid (Qwen3.5) checkpoint (its MoE path: experts quantized to NF4, LoRA on the
attention projections and on every expert's projections), the baseline of benchmarks/steps/train_qlora.py on the same
directory. Run with the baseline packages (../shared/bench: PYTHONPATH=$PWD/.site).

    python3 benchmarks/moe/unsloth_moe.py CHECKPOINT BATCH [BATCH ...] [--ckpt unsloth|false] [--profile]
Random tokens, seq 2048, LoRA r=16, AdamW (fused), steps 3 after 1 warm-up. One JSON line per batch: step time,
tokens/s, peak memory (torch.cuda.max_memory_allocated), how many trainable tensors sit on the experts, and the
out-of-memory error where the batch does not fit. With --profile, a second line per batch: GPU time of one step by
kernel class (torch profiler).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import unsloth  # noqa: E402,F401  (before transformers)
from unsloth import FastLanguageModel  # noqa: E402
import torch  # noqa: E402

from benchmarks.steps.unsloth_dpo import kernel_class as dense_kernel_class  # noqa: E402

# flash-linear-attention's gated delta rule kernels (chunked forward / backward, WY, triangular solve), its short
# convolution and the torch fallback's loops
LINEAR_ATTENTION_KERNELS = ("gated_delta", "chunk_fwd", "chunk_bwd", "chunk_scaled_dot", "solve_tril", "recompute_w_u",
                            "prepare_wy", "wy_fast", "chunk_local_cumsum", "l2norm", "causal_conv1d", "fused_recurrent",
                            "merge_16x16", "kkt")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def kernel_class(name: str) -> str:
    """unsloth_dpo's kernel classes, with the MoE ones (grouped GEMMs, routing) apart."""
    n = name.lower()
    if any(word in n for word in LINEAR_ATTENTION_KERNELS):
        return "linear attention (gated delta)"
    if "grouped" in n or "group_gemm" in n or "moe" in n:
        return "grouped expert gemm"
    if not any(word in n for word in ("dequant", "flash", "fmha", "attn", "sdpa", "gemm", "sm90", "cutlass", "nvjet",
                                      "matmul")) and any(word in n for word in ("sort", "topk", "scatter", "gather",
                                                                                  "index", "histc")):
        return "routing (sort / scatter / gather)"
    return dense_kernel_class(name)


def linear_attention_path(model) -> str | None:
    """Which gated delta rule a hybrid model's linear layers call: flash-linear-attention's Triton kernels when
    it is importable, else transformers' torch loops (None for a model without linear layers)."""
    if not any(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules()):
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch (flash-linear-attention not importable: {type(e).__name__}: {e})"
    return "flash-linear-attention " + importlib.metadata.version("fla-core")


def load(path: str, seq: int, ckpt):
    """Unsloth's model with its LoRA adapters, and the fields that say what it trains."""
    t0 = time.perf_counter()
    model, _ = FastLanguageModel.from_pretrained(model_name=path, max_seq_length=seq, load_in_4bit=True,
                                                 dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0, bias="none",
                                             target_modules=TARGETS, use_gradient_checkpointing=ckpt, random_state=0)
    model.train()
    names = {n: p for n, p in model.named_parameters()}
    trainable = [n for n, p in names.items() if p.requires_grad]
    info = dict(system="unsloth", linear_attention=linear_attention_path(model), version=unsloth.__version__, device=torch.cuda.get_device_name(),
                layers=model.config.num_hidden_layers, load_s=round(load_s, 1), grad_ckpt=str(ckpt),
                trainable_tensors=len(trainable), trainable_on_experts=sum("experts" in n for n in trainable),
                trainable_params=sum(names[n].numel() for n in trainable),
                expert_tensors_4bit=sum(1 for n, p in names.items() if "experts" in n and p.dtype == torch.uint8),
                expert_tensors=sum(1 for n in names if "experts" in n and not n.endswith(("lora_A", "lora_B"))),
                nf4_fused=os.environ.get("UNSLOTH_MOE_NF4_FUSED", "0"), allocated_gib=round(
                    torch.cuda.memory_allocated() / 2**30, 2))
    print(json.dumps({**info, "event": "loaded", "trainable_sample": trainable[:12]}), flush=True)
    return model, info


def run(model, info: dict, batch: int, seq: int, profile: bool, steps: int = 3, warm: int = 1) -> bool:
    """One batch size's steps; False when it ran out of memory."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    x = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    res = dict(info, batch=batch, seq=seq)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times, by_class, top, ok = [], None, None, True
    try:
        for i in range(warm + steps + (1 if profile else 0)):
            prof = None
            if profile and i == warm + steps:
                from torch.profiler import ProfilerActivity, profile as torch_profile

                prof = torch_profile(activities=[ProfilerActivity.CUDA])
                prof.__enter__()
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if prof is not None:
                prof.__exit__(None, None, None)
                groups: dict[str, float] = {}
                kernels: dict[str, float] = {}
                for e in prof.key_averages():
                    if e.device_type.name == "CUDA":
                        c = kernel_class(e.key)
                        groups[c] = groups.get(c, 0.0) + e.self_device_time_total / 1000
                        kernels[e.key[:90]] = kernels.get(e.key[:90], 0.0) + e.self_device_time_total / 1000
                by_class = {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}
                top = {k: round(v, 2) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]}
            elif i >= warm:
                times.append(time.perf_counter() - t)
            print(f"batch {batch} step {i}: {time.perf_counter() - t:.2f} s", file=sys.stderr, flush=True)
        dt = statistics.median(times)
        res.update(step_s=round(dt, 4), tok_s=round(batch * seq / dt), loss=round(float(loss), 4),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    except torch.OutOfMemoryError:
        res.update(error="OOM", peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
        ok = False
    print(json.dumps(res), flush=True)
    if by_class is not None:
        print(json.dumps({"system": "unsloth", "batch": batch, "gpu_ms_by_class": by_class,
                          "gpu_ms": round(sum(by_class.values()), 1), "top_kernels_ms": top}), flush=True)
    del opt, x
    gc.collect()
    torch.cuda.empty_cache()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path")
    ap.add_argument("batches", type=int, nargs="+")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ckpt", default="unsloth", help="use_gradient_checkpointing: unsloth, true or false")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    ckpt = {"false": False, "true": True}.get(args.ckpt.lower(), args.ckpt)
    model, info = load(args.path, args.seq, ckpt)
    for b in args.batches:  # a larger batch after an out-of-memory one would run out too
        if not run(model, info, b, args.seq, args.profile):
            break


if __name__ == "__main__":
    main()
