#!/usr/bin/env bash
# Hold of 2026-11-28 (one GPU, one call): the MoE step of lease 37 again, with the experts dequantized by the Pallas
# NF4 kernel (all experts of a projection as one [E * out, in] weight) instead of XLA's table lookups: the same
# checkpoint (Qwen3-30B-A3B shapes, 24 layers, bf16 quantized on load) at batches 16 and 64. Its losses should be
# lease 37's / 39's (the same weights, tokens and arithmetic).
# bash benchmarks/drivers/poll.sh THIS 42 480
set -u
. benchmarks/tools/lease_queue.sh
run ckpt env PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-30b-a3b --bf16 --layers 24 /tmp/moe30
jt jt-moe-b16 /tmp/moe30 --batch 16 --remat selective --steps 3 --warmup 1
jt jt-moe-b64 /tmp/moe30 --batch 64 --remat selective --steps 3 --warmup 1
stage all-done
