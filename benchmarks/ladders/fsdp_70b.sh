#!/usr/bin/env bash
# Llama-3-70B on two GPUs of one host (random NF4 weights made already sharded; no checkpoint, no disk): the one-GPU
# baseline, data=2, and fsdp=2 with XLA's defaults and with its collective pipelining (the next layer's all-gather
# started inside the current layer's iteration of the layer loop, the loop unrolled twice), at 1 and 2 rows per GPU.
# Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/ladders/fsdp_70b.sh > /tmp/jt/log 2>&1 < /dev/null &
# JSON lines, tagged with the XLA flags of the run, go to /tmp/jt/results.jsonl, each run's whole output and exit
# status to /tmp/jt/runs.log. FSDP efficiency = tok/s on two GPUs / (2 x tok/s on one at the same rows per GPU).
set -u
. "$(dirname "$0")/../tools/run_log.sh"
out=/tmp/jt/results.jsonl
PIPELINED="--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_while_loop_double_buffering=true"
run() {  # run NAME XLA_FLAGS scale_qlora-arguments...
  local name=$1 flags=$2; shift 2
  echo "=== $name $(date +%T)" | tee -a /tmp/jt/stages
  XLA_FLAGS="$flags" PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --remat per-layer "$@" 2>&1 \
    | json_lines | sed -u "s/^{/{\"run\": \"$name\", \"xla_flags\": \"$flags\", /" | tee -a "$out"
  echo "--- $name exit ${PIPESTATUS[0]}" | tee -a /tmp/jt/stages /tmp/jt/runs.log
}
for b in 1 2; do
  CUDA_VISIBLE_DEVICES=0 run one-gpu-b$b "" --gpus 1 --batch-per-gpu $b
  run fsdp2-b$b "" --gpus 2 --mesh fsdp=2 --batch-per-gpu $b
  run fsdp2-pipelined-b$b "$PIPELINED" --gpus 2 --mesh fsdp=2 --batch-per-gpu $b
done
run data2-b1 "" --gpus 2 --mesh data=2 --batch-per-gpu 1
run fsdp2-b1-profile "" --gpus 2 --mesh fsdp=2 --batch-per-gpu 1 --profile /tmp/jt/trace_fsdp2
echo "=== done $(date +%T)" | tee -a /tmp/jt/stages
