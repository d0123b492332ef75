#!/usr/bin/env bash
# Hold of 2026-11-28 (one GPU, one call), after lease 40 (--qat q4_k took 19x the plain step: its sums in ggml's
# order materialized every product on the GPU; they are now XLA's fused sums there): plain QLoRA and --qat q4_k at
# Llama-3-8B shapes, batch 4, seq 2048, remat selective, the same checkpoint and data as lease 40.
# bash benchmarks/drivers/poll.sh THIS 41 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
jt plain-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1
jt qat-q4_k-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_k
stage all-done
