#!/usr/bin/env bash
# Third hold of 2026-11-26 (nvidia-h200-x2), after autotune level 3 for every step and the MLP chain (one dequantized
# MLP weight at a time). Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/drivers/2026-11-26-two-gpu-lease-3.sh > /tmp/jt/log 2>&1 < /dev/null &
# Phase A, two queues. GPU 0: the 70B checkpoint, then the 70B batch-1 offload
# step as `jaxtune.train` compiles it today, compiled before the weights load, and compiled from shapes first then
# dropped (--warm-autotune: does XLA's in-process autotuning cache spare the later compile its buffers?), Unsloth
# batch 1 in the same hold, then one-GPU 70B per-layer batch 2 with a trace (the FSDP baseline's GPU time).
# GPU 1: 8B selective batch 4/8 both sides (the headline at level 3), the GPU-only tests, the 32B rung both sides, then the VRAM ladder's
# 40 GB cap for Unsloth (stopped at a deadline). Phase B, both GPUs: 70B fsdp=2 batch 2 per GPU, traced.
set -u
. benchmarks/tools/run_log.sh
here=$PWD
out=/tmp/jt/results.jsonl
t_start=$(date +%s)
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
status() { echo "--- $1 exit $2" | tee -a /tmp/jt/stages /tmp/jt/runs.log; }
tagged() { json_lines | sed -u "s/^{/{\"run\": \"$1\", /" | tee -a "$out"; }
jt() {  # jt NAME train_qlora-arguments...
  local name=$1; shift
  stage "$name"; PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$@" 2>&1 | tagged "$name"; status "$name" "${PIPESTATUS[0]}"
}
unsloth() {  # unsloth NAME CKPT BATCH
  stage "$1"
  PYTHONPATH=$here/.site:$here/.bench python3 -c "import sys; from unsloth_baseline import run; run(sys.argv[1], int(sys.argv[2]), 2048, False)" \
    "$2" "$3" 2>&1 | tagged "$1"
  status "$1" "${PIPESTATUS[0]}"
}
scale() {  # scale NAME scale_qlora-arguments...
  local name=$1; shift
  stage "$name"
  PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --remat per-layer "$@" 2>&1 | tagged "$name"
  status "$name" "${PIPESTATUS[0]}"
}
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage ckpt70; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-70b /tmp/bnb4_70b 2>&1 | tagged ckpt70
  a70=(/tmp/bnb4_70b --batch 1 --remat offload --steps 4 --warmup 2)
  jt jt70-off "${a70[@]}"
  jt jt70-off-compile-first "${a70[@]}" --compile-first
  jt jt70-off-warm "${a70[@]}" --warm-autotune
  unsloth unsloth70-b1 /tmp/bnb4_70b 1
  scale one-gpu-b2-trace --gpus 1 --batch-per-gpu 2 --profile /tmp/jt/trace_one
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  stage ckpt8; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-8b /tmp/bnb4_8b 2>&1 | tagged ckpt8
  for b in 4 8; do jt jt8-sel-b$b /tmp/bnb4_8b --batch $b --remat selective; done
  for b in 4 8; do unsloth unsloth8-b$b /tmp/bnb4_8b $b; done
  stage gpu-tests; JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tail -25 > /tmp/jt/gpu_tests.log
  status gpu-tests "${PIPESTATUS[0]}"
  stage ckpt32; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-32b /tmp/bnb4_qwen3-32b 2>&1 | tagged ckpt32
  for b in 1 2; do jt jt32-b$b /tmp/bnb4_qwen3-32b --batch $b --remat selective; done
  for b in 1 2; do unsloth unsloth32-b$b /tmp/bnb4_qwen3-32b $b; done
  UNSLOTH_SEQS_40=153977,184773 bash benchmarks/ladders/vram_ladder.sh unsloth-40
}
stage A
gpu0 > /tmp/jt/gpu0.log 2>&1 &
pid0=$!
setsid bash -c "$(declare -f stage status tagged json_lines jt unsloth gpu1); here=$here out=$out; gpu1" > /tmp/jt/gpu1.log 2>&1 &
pid1=$!
wait $pid0
deadline=$((t_start + ${GPU1_DEADLINE_S:-960}))
while kill -0 $pid1 2>/dev/null && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
kill -- -$pid1 2>/dev/null && stage "gpu1 stopped at deadline"
sleep 3
stage B
scale fsdp2-b2-trace --gpus 2 --mesh fsdp=2 --batch-per-gpu 2 --profile /tmp/jt/trace_fsdp
stage all-done
