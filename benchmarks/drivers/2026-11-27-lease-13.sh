#!/usr/bin/env bash
# For the next hold (nvidia-h100-x1), not yet run: the 80 GB H100 uncapped at r=32 with the defaults at a length
# whose executed tokens reach 1.2x Unsloth's advertised 342,733 (411,280: hold 12's 411,280-slot row executed
# 411,217), then the size ladder's 1B / 3B / 8B best batches beside Unsloth again now that bf16 steps compile
# without XLA's Triton GEMM fusions. Detached: bash benchmarks/drivers/poll.sh THIS 13 540
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
sync; echo 3 > /proc/sys/vm/drop_caches
stage jaxtune-80-r32
( echo 1000 > /proc/self/oom_score_adj
  PYTHONPATH=. exec python3 benchmarks/ladders/context_ladder.py /tmp/bnb4_8b --lora-r 32 --remat auto --seqs 411392 ) 2>&1 \
  | tagged jaxtune-80-r32
status jaxtune-80-r32 "${PIPESTATUS[0]}"
ckpt llama3.2-1b /tmp/bnb4_1b
ckpt llama3.2-3b /tmp/bnb4_3b
for m in 1b 3b; do
  jt jt$m-b16 /tmp/bnb4_$m --batch 16 --remat selective --steps 6 --warmup 2
  unsloth unsloth$m-b8 /tmp/bnb4_$m 8
done
jt jt8-b8 /tmp/bnb4_8b --batch 8 --remat selective --steps 6 --warmup 2
unsloth unsloth8-b8 /tmp/bnb4_8b 8
stage all-done
