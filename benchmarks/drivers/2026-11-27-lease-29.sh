#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU, one call): does running GRPO's decode loop as CUDA graphs (XLA command buffers for
# while loops and conditionals) remove the idle time between a decode step's kernels? 8B, 8 x 8 completions.
# bash benchmarks/drivers/poll.sh THIS 29 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run grpo-default env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
run grpo-cmdbuf-while env XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
run grpo-cmdbuf-while-min1 env "XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_graph_min_graph_size=1" PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
stage all-done
