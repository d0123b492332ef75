#!/usr/bin/env bash
# Size ladder (issue: every size, every card): per model shape, jaxtune (bf16 and FP8) and Unsloth at several
# batches, seq 2048, LoRA r=16 on the 7 projections, random tokens, same checkpoint. Detached and polled:
#   setsid bash benchmarks/ladders/size_ladder.sh llama3.2-1b llama3.2-3b > /tmp/jt/log 2>&1 < /dev/null &
# Per-size settings come from the environment (defaults: the 1B rung):
#   JT_BATCHES="1 4 8 16"  FP8_BATCH=16  UNSLOTH_CFGS="1:False 4:False 8:False 16:unsloth" (batch:checkpointing)
#   JT_PROFILE=B       also trace two jaxtune bf16 steps at batch B and summarize GPU time by kernel class
#   UNSLOTH_PROFILE=B  Unsloth's GPU time by kernel class at batch B (no checkpointing; .bench/unsloth_profile.py)
#   KEEP_CKPT=1        keep the checkpoint after the rung (the default deletes it: the disk holds ~64 GB)
# JSON lines (tagged with the model) go to /tmp/jt/results.jsonl, each run's whole output to /tmp/jt/runs.log. Unsloth needs .bench/ and .site/ carried.
set -u
. "$(dirname "$0")/../tools/run_log.sh"
out=/tmp/jt/results.jsonl
here=$PWD
tag() { json_lines | sed -u "s/^{/{\"model\": \"$1\", $2/" | tee -a "$out"; }
# a run's exit status (128 + N: killed by signal N, e.g. 137 SIGKILL from the host's OOM killer, 139 SIGSEGV)
status() { echo "--- $1 exit $2" | tee -a /tmp/jt/stages /tmp/jt/runs.log; }
for m in "$@"; do
  ckpt=/tmp/bnb4_$m
  echo "=== $m $(date +%T)" | tee -a /tmp/jt/stages
  [ -f "$ckpt/config.json" ] || PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model "$m" "$ckpt" > /dev/null
  for b in ${JT_BATCHES:-1 4 8 16}; do
    prof=()
    [ "$b" = "${JT_PROFILE:-}" ] && prof=(--profile /tmp/jt/trace_$m)
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$ckpt" --batch $b --remat selective "${prof[@]}" 2>&1 | tag "$m" ""
    status "$m jaxtune bf16 batch $b" "${PIPESTATUS[0]}"
  done
  PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$ckpt" --batch ${FP8_BATCH:-16} --remat selective --compute fp8 2>&1 | tag "$m" ""
  status "$m jaxtune fp8 batch ${FP8_BATCH:-16}" "${PIPESTATUS[0]}"
  if [ -n "${JT_PROFILE:-}" ] && [ -d /tmp/jt/trace_$m ]; then
    python3 benchmarks/tools/trace_summary.py /tmp/jt/trace_$m 2 25 2>&1 | tag "$m" "\"profile\": \"jaxtune\", \"batch\": $JT_PROFILE, "
  fi
  for cfg in ${UNSLOTH_CFGS:-1:False 4:False 8:False 16:unsloth}; do
    PYTHONPATH=$here/.site:$here/.bench python3 -c "
import sys; from unsloth_baseline import run
ck = sys.argv[3]; run(sys.argv[1], int(sys.argv[2]), 2048, False if ck == 'False' else ck)" "$ckpt" ${cfg%%:*} ${cfg#*:} 2>&1 | tag "$m" ""
    status "$m unsloth $cfg" "${PIPESTATUS[0]}"
  done
  if [ -n "${UNSLOTH_PROFILE:-}" ]; then
    PYTHONPATH=$here/.site python3 .bench/unsloth_profile.py "$ckpt" "$UNSLOTH_PROFILE" 2>&1 | tag "$m" "\"profile\": \"unsloth\", \"batch\": $UNSLOTH_PROFILE, "
  fi
  [ -n "${KEEP_CKPT:-}" ] || rm -rf "$ckpt"
done
echo "=== done $(date +%T)" | tee -a /tmp/jt/stages
