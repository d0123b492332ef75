#!/usr/bin/env bash
# One H200 hold in two calls. PART=moe: the MoE step beside Unsloth on Qwen3-30B-A3B's shapes (24 of 48 layers, bf16
# checkpoint both sides quantize on load): jaxtune's default (experts' VJP, gathering grouped GEMM, bf16 router) and
# its FP8 experts, then Unsloth without checkpointing (carry .site .bench). PART=kernels: the grouped FP8 and bf16
# kernels against cuBLAS and XLA's ragged_dot (with and without the cuDNN fusion flag), the decode attention kernel,
# and continuous against static rollouts and the decode step on an 8B-shaped bnb-4bit checkpoint.
#   PART=moe bash benchmarks/drivers/2026-12-08-hold.sh    (on the device, repository root; outputs under $OUT)
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/device.txt"
if [ "${PART:-moe}" = moe ]; then
  CK=/tmp/moe30
  [ -f $CK/config.json ] || python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-30b-a3b --bf16 --layers 24 $CK 2>&1 | tail -1 \
    | tee -a "$OUT/make.txt"
  timeout 150 python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-32} --remat selective --steps 3 --warmup 1 \
    --profile /tmp/trace_jt 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-300
  python3 benchmarks/tools/trace_summary.py /tmp/trace_jt/b${JB:-32} 2 25 > "$OUT/jaxtune_trace.txt" 2>&1
  timeout 120 python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-32} --remat selective --steps 3 --warmup 1 \
    --compute fp8 --moe-fp8-experts 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-300
  PYTHONPATH=$PWD/.site:$PWD timeout ${UNSLOTH_S:-240} python3 benchmarks/moe/unsloth_moe.py $CK ${UB:-16} \
    --ckpt false --profile > "$OUT/unsloth.jsonl" 2> "$OUT/unsloth.err"
  grep -v '"event": "loaded"' "$OUT/unsloth.jsonl" | cut -c1-600; tail -3 "$OUT/unsloth.err"
else
  timeout 150 python3 benchmarks/moe/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 16384 --fp8 --xla \
    > "$OUT/grouped.jsonl" 2> "$OUT/grouped.err"
  XLA_FLAGS="--xla_gpu_experimental_use_ragged_dot_fusion=true" timeout 60 python3 \
    benchmarks/moe/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 16384 --xla --only-wgmma \
    > "$OUT/grouped-cudnn-flag.jsonl" 2> "$OUT/grouped-cudnn-flag.err"
  timeout 60 python3 benchmarks/kernels/decode_attention.py > "$OUT/decode-attention.jsonl" \
    2> "$OUT/decode-attention.err"
  python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b /tmp/bnb4_8b 2>&1 | tail -1 >> "$OUT/make.txt"
  timeout 170 python3 benchmarks/rl/continuous_rollout.py /tmp/bnb4_8b --completions 256 --slots 64 \
    >> "$OUT/rollout.jsonl" 2>> "$OUT/rollout.err"
  timeout 100 python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --rows 64 --label rows64 --no-trace \
    >> "$OUT/rollout.jsonl" 2>> "$OUT/rollout.err"
fi
true
