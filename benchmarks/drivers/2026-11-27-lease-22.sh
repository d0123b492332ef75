#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call): jaxtune GRPO 8x8 sampling from dense weights merged once per rollout
# (dequantized NF4 + the adapters' product, bf16) beside the default (NF4 dequantize + cuBLAS every token); ran at
# 7de4aaf, whose --merged option was then removed: it gave no gain (rollout 13.05 s against 12.55 s).
# bash benchmarks/drivers/poll.sh THIS 22 560
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run jaxtune-grpo-merged env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --merged
run jaxtune-grpo-default env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
stage all-done
