#!/usr/bin/env bash
# The routed experts' VJP in one hold: a Qwen3-30B-A3B-shaped checkpoint (24 of 48 layers, bf16, both sides
# quantize it on load), jaxtune with the fused VJP (batches JB, profiled at the first) and with autodiff of the
# plain composition (batch PB); Unsloth without checkpointing at UB when UNSLOTH=1 (carry .site .bench).
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
CK=/tmp/moe30
[ -f $CK/config.json ] || { PYTHONPATH=$PWD python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-30b-a3b --bf16 --layers 24 $CK 2>&1 | tail -2 | tee -a "$OUT/make.txt"; }
if [ "${JAXTUNE:-1}" = 1 ]; then
  PYTHONPATH=$PWD timeout ${JT_S:-260} python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-16,32} --remat selective --steps 3 --warmup 1 --profile /tmp/trace_jt 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune.jsonl" | cut -c1-500
  for d in /tmp/trace_jt/b*; do PYTHONPATH=$PWD python3 benchmarks/tools/trace_summary.py $d 2 25 > "$OUT/jaxtune_trace_$(basename $d).txt" 2>&1; head -c 1800 "$OUT/jaxtune_trace_$(basename $d).txt"; done
  PYTHONPATH=$PWD timeout ${PLAIN_S:-150} python3 benchmarks/steps/train_qlora.py $CK --batch ${PB:-16} --remat selective --steps 3 --warmup 1 --moe-mlp plain 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/jaxtune_plain.jsonl" | cut -c1-500
fi
if [ "${UNSLOTH:-0}" = 1 ]; then
  PYTHONPATH=$PWD/.site:$PWD timeout ${UNSLOTH_S:-450} python3 benchmarks/moe/unsloth_moe.py $CK ${UB:-16} --ckpt false --profile > "$OUT/unsloth.jsonl" 2> "$OUT/unsloth.err"
  grep -v '"event": "loaded"' "$OUT/unsloth.jsonl" | cut -c1-900; tail -3 "$OUT/unsloth.err"
fi
true
