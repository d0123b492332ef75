#!/usr/bin/env bash
# The 3B-32B rungs of the size ladder in one detached run, each size at the batches that fit both sides on an
# 80 GB card (Unsloth without checkpointing where it fits, its offloaded checkpointing past that; jaxtune's
# selective plan at 14B batch 8 and 32B batch 4 is over 80 GB), with one
# per-class profile per size on each side. Rungs named as arguments (default: all four, in this order):
#   setsid bash benchmarks/ladders/size_ladder_rungs.sh llama3-8b qwen3-14b qwen3-32b > /tmp/jt/log 2>&1 < /dev/null &
set -u
rung() {
  case "$1" in
    llama3.2-3b) JT_BATCHES="4 8 16" FP8_BATCH=16 UNSLOTH_CFGS="4:False 8:False 16:unsloth" JT_PROFILE=8 UNSLOTH_PROFILE=8 \
                   bash benchmarks/ladders/size_ladder.sh llama3.2-3b ;;
    llama3-8b) JT_BATCHES="4 8" FP8_BATCH=8 UNSLOTH_CFGS="4:False 8:False" JT_PROFILE=4 UNSLOTH_PROFILE=4 \
                 bash benchmarks/ladders/size_ladder.sh llama3-8b ;;
    qwen3-14b) JT_BATCHES="2 4" FP8_BATCH=4 UNSLOTH_CFGS="2:False 4:False 8:unsloth" JT_PROFILE=4 UNSLOTH_PROFILE=4 \
                 bash benchmarks/ladders/size_ladder.sh qwen3-14b ;;
    qwen3-32b) JT_BATCHES="1 2" FP8_BATCH=2 UNSLOTH_CFGS="1:False 2:False" JT_PROFILE=2 UNSLOTH_PROFILE=2 \
                 bash benchmarks/ladders/size_ladder.sh qwen3-32b ;;
    *) echo "unknown rung $1 (llama3.2-3b, llama3-8b, qwen3-14b, qwen3-32b)" >&2; return 2 ;;
  esac
}
for m in "${@:-llama3.2-3b llama3-8b qwen3-14b qwen3-32b}"; do
  for one in $m; do rung "$one"; done
done
