#!/usr/bin/env bash
# Hold of 2026-11-28 (one H200): QAT q4_0's weight by the one-pass Pallas kernel. The kernel against XLA's passes and
# the plain dequantization per 8B weight shape (with its agreement on the GPU), then the training step at Llama-3-8B
# shapes with 16 of its 32 layers (the device time left): plain QLoRA, --qat q4_0 through the kernel, and through XLA.
# bash benchmarks/drivers/poll.sh THIS 45 240
# (as it ran: the kernel was then the GPU default and --qat-xla opted out; since, XLA is the default and
# --qat-kernel opts in)
set -u
. benchmarks/tools/lease_queue.sh
run ckpt env PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b --layers 16 /tmp/bnb4_8b16
run qat-kernel env PYTHONPATH=. python3 benchmarks/kernels/qat_q4_0.py
jt jt-plain /tmp/bnb4_8b16 --batch 4 --remat selective --steps 4 --warmup 1
jt jt-qat-kernel /tmp/bnb4_8b16 --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0
jt jt-qat-xla /tmp/bnb4_8b16 --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0 --qat-xla
stage all-done
