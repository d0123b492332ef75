#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU, one call): the grouped MoE kernel after its weight-block indexing fix (lease 32 read
# past each weight block for column blocks after the first: NaN losses at batch 4 and 8). The kernel's GPU test,
# the kernel at five tilings against cuBLAS, then QLoRA steps on the in-memory Qwen3-30B-A3B shape, seq 2048.
# bash benchmarks/drivers/poll.sh THIS 33 570
set -u
. benchmarks/tools/lease_queue.sh
stage gpu-test; JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_grouped.py 2>&1 | tail -3 | tee -a /tmp/jt/runs.log
run gemm-qwen3 env PYTHONPATH=. timeout 100 python3 benchmarks/moe/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 8192
run gemm-mixtral env PYTHONPATH=. timeout 80 python3 benchmarks/moe/moe_grouped_gemm.py --model mixtral-8x7b --tokens 8192
for b in 1 4 8 16; do
  stage jt-30b-b$b; PYTHONPATH=. timeout 100 python3 benchmarks/steps/train_qlora.py random:qwen3-30b-a3b --batch $b --remat selective --steps 3 --warmup 1 2>&1 | tagged jt-30b-b$b
done
stage all-done
