#!/usr/bin/env bash
# Hold of 2026-11-27 (nvidia-h100-x1): DPO and ORPO at Llama-3-8B shapes on one 80 GB H100, Unsloth + TRL then jaxtune
# in one hold, each at batch 4 and 8 (8 fits neither: recorded), and the GPU time per step by kernel class of both
# DPO sides at batch 4 (torch profiler / jax.profiler, steps 4 and 5).
# Detached: bash benchmarks/drivers/poll.sh THIS 16 540
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
pref() {  # pref NAME COMMAND...: one preference-tuning run, its JSON lines tagged
  local name=$1; shift
  stage "$name"; "$@" 2>&1 | tagged "$name"; status "$name" "${PIPESTATUS[0]}"
}
pref unsloth-dpo-b4 env PYTHONPATH=$here/.site python3 benchmarks/steps/unsloth_dpo.py /tmp/bnb4_8b dpo 4 false profile
pref jaxtune-dpo-b4 env PYTHONPATH=. python3 benchmarks/steps/dpo_qlora.py /tmp/bnb4_8b --objective dpo --batches 4 --profile /tmp/jt/trace
pref unsloth-orpo-b4 env PYTHONPATH=$here/.site python3 benchmarks/steps/unsloth_dpo.py /tmp/bnb4_8b orpo 4 false
pref jaxtune-orpo-b4 env PYTHONPATH=. python3 benchmarks/steps/dpo_qlora.py /tmp/bnb4_8b --objective orpo --batches 4
pref unsloth-dpo-b8 env PYTHONPATH=$here/.site python3 benchmarks/steps/unsloth_dpo.py /tmp/bnb4_8b dpo 8 false
pref jaxtune-dpo-b8 env PYTHONPATH=. python3 benchmarks/steps/dpo_qlora.py /tmp/bnb4_8b --objective dpo --batches 8
stage all-done
