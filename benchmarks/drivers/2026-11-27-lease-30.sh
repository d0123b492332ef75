#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call): the cost of quantization-aware training at Llama-3-8B shapes, batch 4,
# seq 2048, remat selective: plain QLoRA, then --qat q4_0 and --qat nf4, same checkpoint and data.
# bash benchmarks/drivers/poll.sh THIS 30 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
jt plain-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1
jt qat-q4_0-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0
jt qat-nf4-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat nf4
stage all-done
