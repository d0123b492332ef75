#!/usr/bin/env bash
# Qwen3.5 dense beside Unsloth in one hold: the checkpoint written by transformers, jaxtune at JB (profiled by
# kernel class, its top kernels listed), Unsloth without checkpointing at UB (flash-linear-attention on its path,
# profiled), then the Pallas gated delta kernels alone.
# carry: .site .fla-site .bench ; run from the repository root
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
MODEL=${MODEL:-qwen3.5-9b}; LAYERS=${LAYERS:-16}; CK=/tmp/q35_$MODEL
SITE=$PWD/.site:$PWD/.fla-site
[ -d $CK ] || PYTHONPATH=$PWD:$SITE python3 benchmarks/tools/make_random_hf.py --model $MODEL --layers $LAYERS $CK 2>&1 | grep -v Writing | tee -a "$OUT/make.jsonl"
PYTHONPATH=$PWD timeout ${JT_S:-200} python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-16} --remat ${JREMAT:-selective} --steps 3 --warmup 1 --profile /tmp/trace_jt 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-600
for d in /tmp/trace_jt/b*; do PYTHONPATH=$PWD python3 benchmarks/tools/trace_summary.py $d 2 30 > "$OUT/jaxtune_trace_$(basename $d).txt" 2>&1; head -c 2500 "$OUT/jaxtune_trace_$(basename $d).txt"; done
PYTHONPATH=$SITE:$PWD timeout ${UNSLOTH_S:-330} python3 benchmarks/moe/unsloth_moe.py $CK ${UB:-16} --ckpt false --profile > "$OUT/unsloth.jsonl" 2> "$OUT/unsloth.err"
grep -v '"event": "loaded"' "$OUT/unsloth.jsonl" | cut -c1-700; grep "step" "$OUT/unsloth.err" | tail -6
cd benchmarks/kernels && PYTHONPATH=$OLDPWD timeout ${PARTS_S:-60} python3 gated_delta_parts.py --shapes 2x4096 --block-v 64 --warps 4 2>&1 | grep '^{' | tee -a "$OUT/parts.jsonl"
true
