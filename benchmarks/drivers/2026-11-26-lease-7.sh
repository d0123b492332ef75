#!/usr/bin/env bash
# Seventh hold of 2026-11-26 (nvidia-h100-x1): the host offloads on a GPU. The GPU-only tests (among them: the
# optimizer state and the input embedding in host memory train the same and leave the planned device bytes) while
# the 70B and 8B checkpoints are written; XLA's plan of the 70B offload step with both offloads; Llama-3-70B batch 1
# in the recompute class (jaxtune `offload` with and without both offloads, Unsloth with its checkpointing); the
# VRAM ladder's 8 GB rung on both sides above what each passed last hold and jaxtune's 12 GB rung (defaults: remat
# auto's last resort now moves the optimizer state and the embedding too); the 70B unrolled step's concatenations.
# Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/drivers/2026-11-26-lease-7.sh > /tmp/jt/log 2>&1 < /dev/null &
set -u
. benchmarks/tools/lease_queue.sh
unsloth_ckpt() {  # unsloth_ckpt NAME CKPT BATCH: Unsloth with its "unsloth" gradient checkpointing at seq 2048
  stage "$1"
  PYTHONPATH=$here/.site:$here/.bench python3 -c "import sys; from unsloth_baseline import run; run(sys.argv[1], int(sys.argv[2]), 2048, 'unsloth')" \
    "$2" "$3" 2>&1 | tagged "$1"
  status "$1" "${PIPESTATUS[0]}"
}
plan() {  # plan NAME step_memory-arguments...: XLA's memory plan of a step from shapes only
  local name=$1; shift
  stage "$name"; PYTHONPATH=. python3 benchmarks/steps/step_memory.py "$@" 2>&1 | tagged "$name"; status "$name" "${PIPESTATUS[0]}"
}
( export XLA_PYTHON_CLIENT_PREALLOCATE=false; ckpt llama3-70b /tmp/bnb4_70b; ckpt llama3-8b /tmp/bnb4_8b ) &
XLA_PYTHON_CLIENT_PREALLOCATE=false gpu_tests
wait
plan plan70-offload-both --model llama3-70b --batch 1 --remat offload --offload-optimizer --offload-embedding --top 5
a=(/tmp/bnb4_70b --batch 1 --remat offload --steps 4 --warmup 2)
jt jt70-offload-both "${a[@]}" --offload-optimizer --offload-embedding
unsloth_ckpt unsloth70-ckpt /tmp/bnb4_70b 1
jt jt70-offload "${a[@]}"
rung jaxtune-8 JT_SEQS_8=6913,7800,9000,10500
rung unsloth-8 UNSLOTH_SEQS_8=7000,7500,8000,9000
rung jaxtune-12 JT_SEQS_12=28800,32000,36000
plan plan70-unrolled-concats --model llama3-70b --batch 1 --remat selective --unroll-layers --concats 10 --top 3
stage all-done
