#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU, one call): where the GRPO rollout's decode step spends its time (64 rows, 8B shapes):
# the sampler timed, one decode step alone, per-token kernels from two traces; then the same without XLA's command
# buffers (CUDA graphs), to see what kernel launches cost.
# bash benchmarks/drivers/poll.sh THIS 24 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run decode-profile env PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --trace /tmp/jt/trace-a
run decode-profile-no-cmdbuf env PYTHONPATH=. XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --trace /tmp/jt/trace-b --label no-command-buffer
stage all-done
