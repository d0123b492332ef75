#!/usr/bin/env bash
# Hold of 2026-11-27 (two GPUs, one call): GRPO at Llama-3-8B shapes, 8 x 8 completions, on one GPU and on both
# (data-parallel, then FSDP), one process, same checkpoint and prompts.
# bash benchmarks/drivers/poll.sh THIS 28 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run grpo-1gpu env CUDA_VISIBLE_DEVICES=0 PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
run grpo-data2 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --mesh data=2
run grpo-fsdp2 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --mesh fsdp=2
stage all-done
