#!/usr/bin/env bash
# Hold of 2026-11-28 (one GPU, one call): the cost of q4_K quantization-aware training at Llama-3-8B shapes, batch
# 4, seq 2048, remat selective, beside plain QLoRA and --qat q4_0 (the same checkpoint and data, lease 30's runs).
# bash benchmarks/drivers/poll.sh THIS 40 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
jt plain-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1
jt qat-q4_0-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0
jt qat-q4_k-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_k
stage all-done
