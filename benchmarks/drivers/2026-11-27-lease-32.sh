#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU, one call): mixture of experts with the grouped Pallas kernel. The kernel at several
# tilings (and XLA's ragged_dot) against a dense cuBLAS GEMM of the same rows at Qwen3-30B-A3B and Mixtral-8x7B
# shapes, then QLoRA steps on a Qwen3-30B-A3B-shaped model built in memory (random NF4 experts), seq 2048.
# bash benchmarks/drivers/poll.sh THIS 32 570
set -u
. benchmarks/tools/lease_queue.sh
run gemm-qwen3 env PYTHONPATH=. timeout 120 python3 benchmarks/moe/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 8192 --xla
run gemm-mixtral env PYTHONPATH=. timeout 90 python3 benchmarks/moe/moe_grouped_gemm.py --model mixtral-8x7b --tokens 8192
for b in 1 4 8; do
  stage jt-30b-b$b; PYTHONPATH=. timeout 110 python3 benchmarks/steps/train_qlora.py random:qwen3-30b-a3b --batch $b --remat selective --steps 3 --warmup 1 2>&1 | tagged jt-30b-b$b
done
stage all-done
