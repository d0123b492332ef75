#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call): jaxtune GRPO 8x8 with the decode's NF4 projections (64 rows) on the fused
# kernel instead of dequantize + cuBLAS, beside the default in the same hold.
# bash benchmarks/drivers/poll.sh THIS 21 560
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run jaxtune-grpo-fused64 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --fused-rows 64 --profile /tmp/jt/trace21
run jaxtune-grpo-default env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
stage all-done
