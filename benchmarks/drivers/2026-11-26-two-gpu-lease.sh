#!/usr/bin/env bash
# One two-GPU lease (nvidia-h200-x2), detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/drivers/2026-11-26-two-gpu-lease.sh > /tmp/jt/log 2>&1 < /dev/null &
# Phase A, two queues at once. GPU 0: what sets the executed batch-1 peak above XLA's plan (8B per-layer with the
# GEMM autotuner at levels 4/3/1/0 and with the step compiled before the weights load), then the 70B batch-1 step
# the same ways beside Unsloth, then 70B per-layer (exit status of the runs that ended silently before).
# GPU 1: the 32B rung of the size ladder, then the VRAM ladder's 40 GB cap. GPU 1's queue is stopped at a deadline.
# Phase B, both GPUs: 70B over fsdp=2 with and without XLA's collective pipelining, against one GPU.
set -u
. benchmarks/tools/run_log.sh
here=$PWD
out=/tmp/jt/results.jsonl
t_start=$(date +%s)
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
status() { echo "--- $1 exit $2" | tee -a /tmp/jt/stages /tmp/jt/runs.log; }
tagged() { json_lines | sed -u "s/^{/{\"run\": \"$1\", /" | tee -a "$out"; }
jt() {  # jt NAME XLA_FLAGS train_qlora-arguments...
  local name=$1 flags=$2; shift 2
  stage "$name"
  XLA_FLAGS="$flags" PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$@" 2>&1 | tagged "$name"
  status "$name" "${PIPESTATUS[0]}"
}
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage ckpt8; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b /tmp/bnb4_8b 2>&1 | tagged ckpt8
  a8=(/tmp/bnb4_8b --batch 1 --remat per-layer --steps 4 --warmup 2)
  jt jt8-pl-level4 "" "${a8[@]}"
  jt jt8-pl-compile-first "" "${a8[@]}" --compile-first
  for l in 3 1 0; do jt jt8-pl-level$l "--xla_gpu_autotune_level=$l" "${a8[@]}"; done
  stage ckpt70; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-70b /tmp/bnb4_70b 2>&1 | tagged ckpt70
  a70=(/tmp/bnb4_70b --batch 1 --remat offload --steps 4 --warmup 2)
  jt jt70-off-level4 "" "${a70[@]}"
  jt jt70-off-compile-first "" "${a70[@]}" --compile-first
  jt jt70-off-level3 "--xla_gpu_autotune_level=3" "${a70[@]}"
  stage unsloth70
  PYTHONPATH=$here/.site:$here/.bench python3 -c "from unsloth_baseline import run; run('/tmp/bnb4_70b', 1, 2048, 'unsloth')" 2>&1 | tagged unsloth70
  status unsloth70 "${PIPESTATUS[0]}"
  jt jt70-pl "" /tmp/bnb4_70b --batch 1 --remat per-layer --steps 4 --warmup 2
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  bash benchmarks/ladders/size_ladder_rungs.sh qwen3-32b
  while [ ! -f /tmp/bnb4_8b/config.json ]; do sleep 5; done
  bash benchmarks/ladders/vram_ladder.sh jaxtune-40 unsloth-40
}
stage A
gpu0 > /tmp/jt/gpu0.log 2>&1 &
pid0=$!
setsid bash -c "$(declare -f stage status tagged json_lines gpu1); here=$here out=$out; gpu1" > /tmp/jt/gpu1.log 2>&1 &
pid1=$!
wait $pid0
deadline=$((t_start + ${GPU1_DEADLINE_S:-1020}))
while kill -0 $pid1 2>/dev/null && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
kill -- -$pid1 2>/dev/null && stage "gpu1 stopped at deadline"
sleep 3
stage B
scale() {  # scale NAME XLA_FLAGS scale_qlora-arguments...
  local name=$1 flags=$2; shift 2
  stage "$name"
  XLA_FLAGS="$flags" PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --remat per-layer "$@" 2>&1 \
    | json_lines | sed -u "s/^{/{\"run\": \"$name\", \"xla_flags\": \"$flags\", /" | tee -a "$out"
  status "$name" "${PIPESTATUS[0]}"
}
PIPELINED="--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_while_loop_double_buffering=true"
(CUDA_VISIBLE_DEVICES=0 scale one-gpu-b1 "" --gpus 1 --batch-per-gpu 1) &
(CUDA_VISIBLE_DEVICES=1 scale one-gpu-b2 "" --gpus 1 --batch-per-gpu 2) &
wait
scale fsdp2-pipelined-b1 "$PIPELINED" --gpus 2 --mesh fsdp=2 --batch-per-gpu 1
scale fsdp2-b1 "" --gpus 2 --mesh fsdp=2 --batch-per-gpu 1
scale fsdp2-pipelined-b2 "$PIPELINED" --gpus 2 --mesh fsdp=2 --batch-per-gpu 2
scale fsdp2-b2 "" --gpus 2 --mesh fsdp=2 --batch-per-gpu 2
stage all-done
