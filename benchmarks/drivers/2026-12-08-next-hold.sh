#!/usr/bin/env bash
# The next hold (one H100 or H200, two calls of under 10 minutes; each call's outputs are at most 8 files).
# PART=moe: the MoE step beside Unsloth again (router and LoRA-sum GEMMs on tensor cores, down's LoRA part of the
# routing gradient from the rank), its trace by class, the HLO of the trace's top reductions and fusions, and a
# larger batch under remat recompute-experts.
# PART=kernels: tokamax's ragged_dot beside the Pallas grouped GEMM, and the per-expert LoRA gradient kernel
# (carry .whl: tokamax and its missing dependencies, benchmarks/moe/site_shims for xprof), then continuous against
# static rollouts with the decode attention kernel on, each traced (kernels and GPU time per decoding step).
#   PART=moe bash benchmarks/drivers/2026-12-08-next-hold.sh    (carry .site .bench)
#   PART=kernels bash benchmarks/drivers/2026-12-08-next-hold.sh    (carry .whl)
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/log.txt"
if [ "${PART:-moe}" = moe ]; then
  CK=/tmp/moe30
  [ -f $CK/config.json ] || python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-30b-a3b --bf16 \
    --layers 24 $CK 2>&1 | tail -1 >> "$OUT/log.txt"
  XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*step.*" timeout 170 \
    python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-16} --remat selective --steps 3 --warmup 1 \
    --profile /tmp/trace_jt 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-300
  python3 benchmarks/tools/trace_summary.py /tmp/trace_jt/b${JB:-16} 2 40 > "$OUT/jaxtune_trace.txt" 2>&1
  top=$(grep -o '"kernel": "[a-z_0-9]*fusion[a-z_0-9]*"' "$OUT/jaxtune_trace.txt" | head -12 | cut -d'"' -f4)
  python3 benchmarks/tools/hlo_fusions.py /tmp/hlo $top > "$OUT/hlo_fusions.txt" 2>&1
  # the batch "selective" cannot fit, with the routed rows' gate/up recomputed instead of kept
  timeout 150 python3 benchmarks/steps/train_qlora.py $CK --batch ${JB2:-32} --remat recompute-experts --steps 3 \
    --warmup 1 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-300
  PYTHONPATH=$PWD/.site:$PWD timeout ${UNSLOTH_S:-200} python3 benchmarks/moe/unsloth_moe.py $CK ${UB:-8} \
    --ckpt false --profile > "$OUT/unsloth.jsonl" 2> "$OUT/unsloth.err"
  grep -v '"event": "loaded"' "$OUT/unsloth.jsonl" | cut -c1-600
else
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  PYTHONPATH=$PWD:/tmp/site:$PWD/benchmarks/moe/site_shims timeout 150 python3 benchmarks/moe/moe_grouped_gemm.py \
    --model qwen3-30b-a3b --tokens 16384 --tokamax --weight-grad > "$OUT/grouped.jsonl" 2>> "$OUT/log.txt"
  [ -f /tmp/bnb4_8b/config.json ] || python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b /tmp/bnb4_8b \
    2>&1 | tail -1 >> "$OUT/log.txt"
  timeout 300 python3 benchmarks/rl/continuous_rollout.py /tmp/bnb4_8b --completions 256 --slots 64 \
    --trace /tmp/rollout_trace > "$OUT/rollout.jsonl" 2>> "$OUT/log.txt"
  cat "$OUT/rollout.jsonl" | cut -c1-1500
fi
true
