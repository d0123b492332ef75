#!/usr/bin/env bash
# gpt-oss-20b shapes beside Unsloth in one hold: a random bf16 checkpoint written by transformers (LAYERS of 24
# layers, both sides quantize it to NF4 at load), jaxtune at JB (profiled by kernel class at each batch), Unsloth
# without checkpointing at UB (profiled). seq 2048, LoRA r=16 on attention and every expert.
# carry: .site ; run from the repository root
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
python3 -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)' | tee -a "$OUT/env.txt"
LAYERS=${LAYERS:-8}; CK=/tmp/goss_$LAYERS
[ -d $CK ] || PYTHONPATH=$PWD python3 benchmarks/tools/make_random_hf.py --model gpt-oss-20b --layers $LAYERS $CK 2>&1 | grep -v Writing | tee -a "$OUT/make.jsonl"
if [ "${JAXTUNE:-1}" = 1 ]; then
  PYTHONPATH=$PWD timeout ${JT_S:-240} python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-8,16,32} --remat selective --steps 3 --warmup 1 --profile /tmp/trace_jt 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-600
  for d in /tmp/trace_jt/b*; do PYTHONPATH=$PWD python3 benchmarks/tools/trace_summary.py $d 2 25 > "$OUT/jaxtune_trace_$(basename $d).txt" 2>&1; head -c 1500 "$OUT/jaxtune_trace_$(basename $d).txt"; done
fi
if [ "${UNSLOTH:-1}" = 1 ]; then
  PYTHONPATH=$PWD/.site:$PWD timeout ${UNSLOTH_S:-330} python3 benchmarks/moe/unsloth_moe.py $CK ${UB:-8 16} --ckpt false --profile > "$OUT/unsloth.jsonl" 2> "$OUT/unsloth.err"
  grep -v '"event": "loaded"' "$OUT/unsloth.jsonl" | cut -c1-900; grep -iE "error|step" "$OUT/unsloth.err" | tail -8
fi
true
