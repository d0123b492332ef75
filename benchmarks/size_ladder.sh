#!/usr/bin/env bash
# Size ladder (issue: every size, every card): per model shape, jaxtune (bf16 and FP8) and Unsloth at several
# batches, seq 2048, LoRA r=16 on the 7 projections, random tokens, same checkpoint. Detached and polled:
#   setsid bash benchmarks/size_ladder.sh llama3.2-1b llama3.2-3b > /tmp/jt/log 2>&1 < /dev/null &
# JSON lines (tagged with the model) go to /tmp/jt/results.jsonl. Unsloth needs .bench/ and .site/ carried.
set -u
mkdir -p /tmp/jt
out=/tmp/jt/results.jsonl
here=$PWD
tag() { grep --line-buffered '^{"' | sed -u "s/^{/{\"model\": \"$1\", /" | tee -a "$out"; }
for m in "$@"; do
  ckpt=/tmp/bnb4_$m
  echo "=== $m $(date +%T)" | tee -a /tmp/jt/stages
  [ -f "$ckpt/config.json" ] || PYTHONPATH=. python3 benchmarks/make_bnb4_checkpoint.py --model "$m" "$ckpt" > /dev/null
  for b in ${JT_BATCHES:-1 4 8 16}; do
    PYTHONPATH=. python3 benchmarks/train_qlora.py "$ckpt" --batch $b --remat selective 2>&1 | tag "$m"
  done
  PYTHONPATH=. python3 benchmarks/train_qlora.py "$ckpt" --batch ${FP8_BATCH:-16} --remat selective --compute fp8 2>&1 | tag "$m"
  for cfg in ${UNSLOTH_CFGS:-1:False 4:False 8:False 16:unsloth}; do
    PYTHONPATH=$here/.site:$here/.bench python3 -c "
import sys; from unsloth_baseline import run
ck = sys.argv[3]; run(sys.argv[1], int(sys.argv[2]), 2048, False if ck == 'False' else ck)" "$ckpt" ${cfg%%:*} ${cfg#*:} 2>&1 | tag "$m"
  done
done
echo "=== done $(date +%T)" | tee -a /tmp/jt/stages
