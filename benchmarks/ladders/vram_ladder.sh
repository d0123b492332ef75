#!/usr/bin/env bash
# VRAM ladder (Llama-3-8B shapes, batch 1, LoRA r=32, as Unsloth's published table): the longest executed step of
# jaxtune (its defaults: remat auto) and of Unsloth (use_gradient_checkpointing="unsloth") with the GPU capped at
# each card size. Long, so it runs detached and is polled (copy /tmp/jt/results.jsonl back on every poll):
#   setsid bash benchmarks/ladders/vram_ladder.sh checkpoint jaxtune-24 unsloth-24 jaxtune-8 unsloth-8 \
#     > /tmp/jt/log 2>&1 < /dev/null &
# Stages: checkpoint, jaxtune-<GB>, unsloth-<GB> for GB in 8 12 16 24 40 48 80. Each side climbs its lengths in
# ascending order and stops at the first that fails; jaxtune's start at 1.2x Unsloth's published figure (the
# target), Unsloth's at its published figure. Override a list with JT_SEQS_<GB> / UNSLOTH_SEQS_<GB>.
# JSON lines go to /tmp/jt/results.jsonl (host memory left during each step included). Unsloth needs .bench/ and
# .site/ carried (../shared/bench).
set -u
. "$(dirname "$0")/../tools/run_log.sh"
ckpt=${CKPT:-/tmp/bnb4_8b}
out=/tmp/jt/results.jsonl
here=$PWD
declare -A published=([8]=2972 [12]=21848 [16]=40724 [24]=78475 [40]=153977 [48]=191728 [80]=342733)
json() { json_lines | tee -a "$out"; }
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
# lengths: `published` x each percentage, rounded up
ladder() { local p=$1 f s=(); shift; for f in "$@"; do s+=($(( (p * f + 99) / 100 ))); done; local IFS=,; echo "${s[*]}"; }
for s in "$@"; do
  stage "$s"
  gb=${s##*-}
  case "$s" in
    checkpoint) [ -f "$ckpt/config.json" ] || PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b "$ckpt" | json ;;
    jaxtune-*)
      var=JT_SEQS_$gb
      seqs=${!var:-$(ladder ${published[$gb]} 120 135 150 175)}
      PYTHONPATH=. python3 benchmarks/ladders/context_ladder.py "$ckpt" --cap-gib "$gb" --lora-r 32 --remat auto --seqs "$seqs" \
        | sed -u "s/^{/{\"published_unsloth\": ${published[$gb]}, /" | json ;;
    unsloth-*)
      var=UNSLOTH_SEQS_$gb
      seqs=${!var:-$(ladder ${published[$gb]} 100 120 140)}
      PYTHONPATH=$here/.site python3 benchmarks/ladders/unsloth_context.py "$ckpt" --cap-gib "$gb" --lora-r 32 --seqs "$seqs" \
        | sed -u "s/^{/{\"published_unsloth\": ${published[$gb]}, /" | json ;;
    *) echo "unknown stage $s" ;;
  esac
  echo "--- $s exit statuses: ${PIPESTATUS[*]}" | tee -a /tmp/jt/stages
done
stage done
