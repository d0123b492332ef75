#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU, one call): the grouped MoE kernel with 128-row tiles (the fastest tiling of lease
# 33): its GPU test, QLoRA steps on the in-memory Qwen3-30B-A3B shape (seq 2048), and the per-class GPU time of
# two steps at batch 8.
# bash benchmarks/drivers/poll.sh THIS 35 570
set -u
. benchmarks/tools/lease_queue.sh
stage gpu-test; JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_grouped.py 2>&1 | tail -30 | tee -a /tmp/jt/runs.log
for b in 4 16; do
  stage jt-30b-b$b; PYTHONPATH=. timeout 100 python3 benchmarks/steps/train_qlora.py random:qwen3-30b-a3b --batch $b --remat selective --steps 3 --warmup 1 2>&1 | tagged jt-30b-b$b
done
stage jt-30b-b8-profile
PYTHONPATH=. timeout 150 python3 benchmarks/steps/train_qlora.py random:qwen3-30b-a3b --batch 8 --remat selective --steps 3 --warmup 1 --profile /tmp/jt/prof 2>&1 | tagged jt-30b-b8
run trace-b8 python3 benchmarks/tools/trace_summary.py /tmp/jt/prof 2 25
stage all-done
