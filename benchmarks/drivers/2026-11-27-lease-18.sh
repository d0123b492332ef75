#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU), after lease 17: jaxtune GRPO with the KV cache updated in place (the layer loop's
# carry), the decode's NF4 projections by dequantize + cuBLAS (default) or the fused kernel up to 64 rows.
# Detached: bash benchmarks/drivers/poll.sh THIS 18 540
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run jaxtune-grpo-inplace env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 4 --profile /tmp/jt/trace18
run jaxtune-grpo-fused64 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 4 --fused-rows 64
stage all-done
