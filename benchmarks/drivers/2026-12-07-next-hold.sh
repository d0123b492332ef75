#!/usr/bin/env bash
# What the next device hold measures first (one H100/H200, ~25 min): the grouped FP8 expert kernel against the bf16
# kernels and cuBLAS (dense bf16 and FP8) at Qwen3-30B-A3B's and gpt-oss-20b's expert shapes, XLA's ragged_dot with
# and without its cuDNN fusion flag; then continuous against static rollouts on an 8B-shaped bnb-4bit checkpoint
# with completions of varying length, the decode attention kernel against XLA's, and the decode step's profile at 16
# and 64 rows.
#   bash benchmarks/drivers/2026-12-07-next-hold.sh   (on the device, repository root; outputs under $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
for model in qwen3-30b-a3b gpt-oss-20b; do
  timeout 240 python3 benchmarks/moe/moe_grouped_gemm.py --model "$model" --tokens 16384 --fp8 --wgmma --xla \
    > "$OUT/grouped-$model.jsonl" 2> "$OUT/grouped-$model.err"
  XLA_FLAGS="--xla_gpu_experimental_use_ragged_dot_fusion=true" timeout 120 python3 benchmarks/moe/moe_grouped_gemm.py \
    --model "$model" --tokens 16384 --xla --only-wgmma > "$OUT/grouped-$model-cudnn-flag.jsonl" \
    2> "$OUT/grouped-$model-cudnn-flag.err"
done
timeout 120 python3 benchmarks/kernels/decode_attention.py > "$OUT/decode-attention.jsonl" 2> "$OUT/decode-attention.err"
timeout 300 python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b /tmp/bnb4_8b > "$OUT/checkpoint.txt" 2>&1
for slots in 64 32; do
  timeout 400 python3 benchmarks/rl/continuous_rollout.py /tmp/bnb4_8b --completions 256 --slots "$slots" \
    >> "$OUT/continuous.jsonl" 2>> "$OUT/continuous.err"
done
for rows in 16 64; do
  timeout 400 python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --rows "$rows" --label "rows$rows" \
    --trace /tmp/decode_trace_$rows >> "$OUT/decode-profile.jsonl" 2>> "$OUT/decode-profile.err"
done
