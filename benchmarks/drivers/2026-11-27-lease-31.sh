#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call): mixture of experts. The grouped expert GEMM (jax.lax.ragged_dot) against
# a dense cuBLAS GEMM of the same FLOPs at Qwen3-30B-A3B and Mixtral-8x7B shapes, then a QLoRA step on a
# Qwen3-30B-A3B-shaped model built in memory (random NF4 experts), batch 1, seq 2048.
# bash benchmarks/drivers/poll.sh THIS 31 570
set -u
. benchmarks/tools/lease_queue.sh
run gemm-qwen3 env PYTHONPATH=. timeout 150 python3 benchmarks/moe/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 8192
run gemm-mixtral env PYTHONPATH=. timeout 120 python3 benchmarks/moe/moe_grouped_gemm.py --model mixtral-8x7b --tokens 8192
stage jt-30b-b1; PYTHONPATH=. timeout 280 python3 benchmarks/steps/train_qlora.py random:qwen3-30b-a3b --batch 1 --remat selective --steps 3 --warmup 1 2>&1 | tagged jt-30b-b1
stage all-done
