#!/usr/bin/env bash
# Next hold (one H200 or H100; not run on 2026-11-28: that session's device time was spent). Carry .site and .bench.
# 1. The QAT q4_0 kernel after lease 45: IEEE float32 LoRA products (Triton's default was TF32) and its inputs out of
#    the gradient (lease 45's kernel step failed differentiating the pallas_call). The kernel per 8B shape (agreement
#    with XLA's passes on the GPU), then the step at Llama-3-8B shapes: plain QLoRA, --qat q4_0 through the kernel
#    (--qat-kernel) and through XLA, in this hold. If the kernel's step is within 15% of plain, set
#    jaxtune/ops/dispatch.py's QAT_KERNEL_ON_GPU = True.
# 2. GRPO with per-layer KV caches capped at a 24 GB card (23.5 GiB) beside Unsloth + TRL, in this hold: the memory
#    target (<= Unsloth's peak) with the new cache.
# bash benchmarks/results/raw/poll.sh THIS 46 570   (then poll again for the rest)
set -u
. benchmarks/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run qat-kernel env PYTHONPATH=. python3 benchmarks/qat_q4_0.py
jt jt-plain /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1
jt jt-qat-kernel /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0 --qat-kernel
jt jt-qat-xla /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0
run jaxtune-grpo-cap24 env PYTHONPATH=. python3 benchmarks/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --cap-gib 23.5
run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
stage all-done
