#!/usr/bin/env bash
# DPO and ORPO at Llama-3-8B shapes on one GPU, jaxtune beside Unsloth + TRL, same machine, same checkpoint, same
# pairs (prompt 1,024 tokens, each sequence cut to 2,048). Long, so it runs detached and is polled:
#   setsid bash benchmarks/steps/dpo_vs_unsloth.sh checkpoint unsloth-dpo jaxtune-dpo unsloth-orpo jaxtune-orpo \
#     > /tmp/jt/log 2>&1 < /dev/null &
# JSON lines go to /tmp/jt/results.jsonl, stage marks to /tmp/jt/stages. Unsloth needs .bench/ and .site/ carried.
# Each side runs its larger batches too, up to one past what fits: a batch that runs out of memory is a result
# ({"error": "OOM"}), so "best batch that fits" is read from the lines of both sides.
set -u
. "$(dirname "$0")/../tools/run_log.sh"
ckpt=/tmp/bnb4_8b
out=/tmp/jt/results.jsonl
here=$PWD
json() { json_lines | tee -a "$out"; }
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
for s in "$@"; do
  stage "$s"
  case "$s" in
    checkpoint) [ -f "$ckpt/config.json" ] || PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b "$ckpt" | json ;;
    unsloth-dpo|unsloth-orpo)
      for cfg in ${UNSLOTH_CFGS:-2:false 4:false 8:false 8:unsloth}; do  # batch:gradient checkpointing
        PYTHONPATH=$here/.site python3 benchmarks/steps/unsloth_dpo.py "$ckpt" ${s#unsloth-} ${cfg%%:*} ${cfg#*:} | json
      done ;;
    jaxtune-dpo|jaxtune-orpo)
      PYTHONPATH=. python3 benchmarks/steps/dpo_qlora.py "$ckpt" --objective ${s#jaxtune-} --batches ${JT_BATCHES:-2,4,8} | json ;;
    jaxtune-dpo-fp8) PYTHONPATH=. python3 benchmarks/steps/dpo_qlora.py "$ckpt" --objective dpo --compute fp8 --batches ${JT_BATCHES:-4,8} | json ;;
    *) echo "unknown stage $s" ;;
  esac
  echo "--- $s exit statuses: ${PIPESTATUS[*]}" | tee -a /tmp/jt/stages
done
stage done
