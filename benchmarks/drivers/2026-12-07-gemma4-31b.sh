#!/usr/bin/env bash
# Gemma 4 31B shapes (6 of 60 layers: five sliding, one full) beside Unsloth in one hold, seq 2048, LoRA r=16.
# carry: .site
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
CK=/tmp/g4_31b
python3 -c 'import transformers; print("transformers", transformers.__version__)'
[ -d $CK ] || PYTHONPATH=$PWD python3 benchmarks/tools/make_random_hf.py --model gemma4-31b --layers 6 $CK 2>&1 | grep -v Writing | tee -a "$OUT/make.jsonl"
PYTHONPATH=$PWD timeout ${JT_S:-220} python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-4,8} --remat selective --steps 3 --warmup 1 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-300
PYTHONPATH=$PWD/.site:$PWD timeout ${UNSLOTH_S:-180} python3 benchmarks/moe/unsloth_moe.py $CK ${UB:-4 8} --ckpt false > "$OUT/unsloth.jsonl" 2> "$OUT/unsloth.err"
cut -c1-600 "$OUT/unsloth.jsonl"; grep -iE "error|step" "$OUT/unsloth.err" | tail -5
true
