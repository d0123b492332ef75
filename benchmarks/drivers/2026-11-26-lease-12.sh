#!/usr/bin/env bash
# Twelfth hold of 2026-11-26 (nvidia-h100-x1): Llama-3.2-1B and 3B at batch 16 with and without XLA's Triton GEMM
# fusions (whether switching them off, +1.8% at Qwen3-32B and +0.8% at 8B in the eleventh hold, holds at the small
# sizes), then the 80 GB H100 uncapped at r=32 with the defaults (the tenth hold's machine stopped answering during
# this run: the page cache is dropped first and the run is the first the kernel's OOM killer would pick).
#   bash benchmarks/drivers/poll.sh benchmarks/drivers/2026-11-26-lease-12.sh 12 540
set -u
. benchmarks/tools/lease_queue.sh
NO_TRITON="--xla_gpu_enable_triton_gemm=false"
ckpt llama3.2-1b /tmp/bnb4_1b
ckpt llama3.2-3b /tmp/bnb4_3b
for m in 1b 3b; do
  jt jt$m-b16 /tmp/bnb4_$m --batch 16 --remat selective --steps 6 --warmup 2
  XLA_FLAGS=$NO_TRITON jt jt$m-b16-no-triton-gemm /tmp/bnb4_$m --batch 16 --remat selective --steps 6 --warmup 2
done
ckpt llama3-8b /tmp/bnb4_8b
rm -rf /tmp/bnb4_1b /tmp/bnb4_3b
sync; echo 3 > /proc/sys/vm/drop_caches
stage jaxtune-80-r32
grep -E "MemTotal|MemAvailable" /proc/meminfo | tee -a /tmp/jt/stages
( echo 1000 > /proc/self/oom_score_adj
  PYTHONPATH=. exec python3 benchmarks/ladders/context_ladder.py /tmp/bnb4_8b --lora-r 32 --remat auto --seqs 411280 ) 2>&1 \
  | tagged jaxtune-80-r32
status jaxtune-80-r32 "${PIPESTATUS[0]}"
stage all-done
