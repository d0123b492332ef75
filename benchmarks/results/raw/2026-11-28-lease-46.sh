#!/usr/bin/env bash
# Hold of 2026-11-28 (one H200), after lease 45: the QAT q4_0 kernel with IEEE float32 LoRA products (Triton's
# default was TF32) and its inputs out of the gradient (lease 45's step failed differentiating the pallas_call).
# The kernel per 8B shape (agreement with XLA's passes on the GPU), then the step at Llama-3-8B shapes with 16 of
# its 32 layers: plain QLoRA and --qat q4_0 through the kernel, in this hold.
# bash benchmarks/results/raw/poll.sh THIS 46 150   (not run: the session's device time was spent; run it next, with --qat-kernel)
set -u
. benchmarks/lease_queue.sh
run ckpt env PYTHONPATH=. python3 benchmarks/make_bnb4_checkpoint.py --model llama3-8b --layers 16 /tmp/bnb4_8b16
jt jt-plain /tmp/bnb4_8b16 --batch 4 --remat selective --steps 4 --warmup 1
jt jt-qat-kernel /tmp/bnb4_8b16 --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0 --qat-kernel
jt jt-qat-xla /tmp/bnb4_8b16 --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0
run qat-kernel env PYTHONPATH=. python3 benchmarks/qat_q4_0.py
stage all-done
