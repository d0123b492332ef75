#!/usr/bin/env bash
# Eighth hold of 2026-11-26 (nvidia-h100-x1), after the seventh: the GPU-only tests again (the planned-bytes test's
# bound set from what the seventh measured) while the 8B checkpoint is written; XLA's plan of the 70B offload step
# with both host offloads (its stderr kept: the seventh hold's attempt failed); jaxtune's 8 and 12 GB rungs above
# the lengths that all passed in the seventh hold (defaults); the 80 GB H100 uncapped at r=32; the 70B unrolled
# step's concatenations. Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/drivers/2026-11-26-lease-8.sh > /tmp/jt/log 2>&1 < /dev/null &
set -u
. benchmarks/tools/lease_queue.sh
plan() {  # plan NAME step_memory-arguments...: XLA's memory plan of a step from shapes only
  local name=$1; shift
  stage "$name"
  PYTHONPATH=. python3 benchmarks/steps/step_memory.py "$@" 2> "/tmp/jt/$name.err" | tagged "$name"
  status "$name" "${PIPESTATUS[0]}"
}
uncapped() {  # uncapped NAME LENGTHS: the longest 8B step at r=32 on the whole GPU (defaults)
  stage "$1"
  PYTHONPATH=. python3 benchmarks/ladders/context_ladder.py /tmp/bnb4_8b --lora-r 32 --remat auto --seqs "$2" 2>&1 | tagged "$1"
  status "$1" "${PIPESTATUS[0]}"
}
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 ckpt llama3-8b /tmp/bnb4_8b ) &
gpu_tests
wait
plan plan70-offload-both --model llama3-70b --batch 1 --remat offload --offload-optimizer --offload-embedding --top 5
rung jaxtune-8 JT_SEQS_8=12000,14500,17500,21000
rung jaxtune-12 JT_SEQS_12=41000,47000,54000
uncapped jaxtune-80-r32 411280,450000
plan plan70-unrolled-concats --model llama3-70b --batch 1 --remat selective --unroll-layers --concats 10 --top 3
stage all-done
