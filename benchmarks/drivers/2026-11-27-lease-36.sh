#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100 80GB, one call): mixture-of-experts QLoRA steps on one 80 GB card, seq 2048, remat
# selective, models built in memory with random NF4 experts: Mixtral-8x7B shapes at batch 1, 2, 4 and Qwen3-30B-A3B
# shapes at batch 8 and 16.
# bash benchmarks/drivers/poll.sh THIS 36 570
set -u
. benchmarks/tools/lease_queue.sh
for b in 1 2 4; do
  stage jt-mixtral-b$b; PYTHONPATH=. timeout 130 python3 benchmarks/steps/train_qlora.py random:mixtral-8x7b --batch $b --remat selective --steps 3 --warmup 1 2>&1 | tagged jt-mixtral-b$b
done
for b in 8 16; do
  stage jt-30b-b$b; PYTHONPATH=. timeout 100 python3 benchmarks/steps/train_qlora.py random:qwen3-30b-a3b --batch $b --remat selective --steps 3 --warmup 1 2>&1 | tagged jt-30b-b$b
done
stage all-done
