#!/usr/bin/env bash
# Second hold of 2026-11-26's evening (nvidia-h100-x1): Qwen3-14B at batch 4 with Unsloth, jaxtune bf16 (no Triton
# GEMM fusions) and FP8 in one hold (its FP8 ratio was across leases), then a second sample of 1B / 3B / 8B with
# Unsloth first (hold 13 ran jaxtune first), FP8 beside them.
# Detached: bash benchmarks/drivers/poll.sh THIS 14 540
set -u
. benchmarks/tools/lease_queue.sh
ckpt qwen3-14b /tmp/bnb4_14b
unsloth unsloth14-b4 /tmp/bnb4_14b 4
jt jt14-b4 /tmp/bnb4_14b --batch 4 --remat selective --steps 6 --warmup 2
jt jt14-fp8-b4 /tmp/bnb4_14b --batch 4 --remat selective --compute fp8 --steps 6 --warmup 2
rm -rf /tmp/bnb4_14b
ckpt llama3.2-1b /tmp/bnb4_1b
ckpt llama3.2-3b /tmp/bnb4_3b
for m in 1b 3b; do
  unsloth unsloth$m-b8 /tmp/bnb4_$m 8
  jt jt$m-b16 /tmp/bnb4_$m --batch 16 --remat selective --steps 6 --warmup 2
  jt jt$m-fp8-b16 /tmp/bnb4_$m --batch 16 --remat selective --compute fp8 --steps 6 --warmup 2
done
ckpt llama3-8b /tmp/bnb4_8b
unsloth unsloth8-b8 /tmp/bnb4_8b 8
jt jt8-b8 /tmp/bnb4_8b --batch 8 --remat selective --steps 6 --warmup 2
jt jt8-fp8-b8 /tmp/bnb4_8b --batch 8 --remat selective --compute fp8 --steps 6 --warmup 2
stage all-done
