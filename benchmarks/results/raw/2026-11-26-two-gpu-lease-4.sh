#!/usr/bin/env bash
# Fourth hold of 2026-11-26 (nvidia-h200-x2): the unrolled layer loop (no stacks of saved activations) against the
# loop at 70B, 32B and 8B beside Unsloth, the GPU-only tests, then the 70B FSDP step after "FSDP moves weights, not
# activations", then the two-process checks. Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/results/raw/2026-11-26-two-gpu-lease-4.sh > /tmp/jt/log 2>&1 < /dev/null &
# Phase A, two queues (both GPUs busy throughout, so every run has a neighbour). GPU 0: the 70B checkpoint, batch 1
# selective looped and unrolled (traced), Unsloth batch 1 without checkpointing. GPU 1: the Qwen3-32B rung at batch
# 2 the same way, 8B batch 4 both ways, the GPU-only tests. Phase B, both GPUs: 70B per-layer batch 2 per GPU on one
# GPU and with fsdp=2 (traced). Phase C: the two-process checks (resume, auto batch, SIGTERM, SIGKILL).
set -u
. benchmarks/run_log.sh
here=$PWD
out=/tmp/jt/results.jsonl
t_start=$(date +%s)
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
status() { echo "--- $1 exit $2" | tee -a /tmp/jt/stages /tmp/jt/runs.log; }
tagged() { json_lines | sed -u "s/^{/{\"run\": \"$1\", /" | tee -a "$out"; }
jt() {  # jt NAME train_qlora-arguments...
  local name=$1; shift
  stage "$name"; PYTHONPATH=. python3 benchmarks/train_qlora.py "$@" 2>&1 | tagged "$name"; status "$name" "${PIPESTATUS[0]}"
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
  PYTHONPATH=. python3 benchmarks/scale_qlora.py --model llama3-70b --remat per-layer "$@" 2>&1 | tagged "$name"
  status "$name" "${PIPESTATUS[0]}"
}
ckpt() { stage "ckpt-$1"; PYTHONPATH=. python3 benchmarks/make_bnb4_checkpoint.py --model "$1" "$2" 2>&1 | tagged "ckpt-$1"; }
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  ckpt llama3-70b /tmp/bnb4_70b
  a=(/tmp/bnb4_70b --batch 1 --remat selective --steps 6 --warmup 2)
  jt jt70-b1-loop "${a[@]}"
  jt jt70-b1-unrolled "${a[@]}" --unroll-layers --profile /tmp/jt/trace70u
  python3 benchmarks/trace_summary.py /tmp/jt/trace70u 2 25 2>&1 | tagged jt70-b1-unrolled-profile
  unsloth unsloth70-b1 /tmp/bnb4_70b 1
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  ckpt qwen3-32b /tmp/bnb4_32b
  a=(/tmp/bnb4_32b --batch 2 --remat selective --steps 6 --warmup 2)
  jt jt32-b2-loop "${a[@]}"
  jt jt32-b2-unrolled "${a[@]}" --unroll-layers
  unsloth unsloth32-b2 /tmp/bnb4_32b 2
  ckpt llama3-8b /tmp/bnb4_8b
  a=(/tmp/bnb4_8b --batch 4 --remat selective --steps 8 --warmup 2)
  jt jt8-b4-loop "${a[@]}"
  jt jt8-b4-unrolled "${a[@]}" --unroll-layers
  stage gpu-tests
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider $(grep -l mark.gpu tests/test_*.py) 2>&1 \
    | tail -30 > /tmp/jt/gpu_tests.log
  status gpu-tests "${PIPESTATUS[0]}"
}
stage A
gpu0 > /tmp/jt/gpu0.log 2>&1 &
pid0=$!
setsid bash -c "$(declare -f stage status tagged json_lines jt unsloth ckpt gpu1); here=$here out=$out; gpu1" > /tmp/jt/gpu1.log 2>&1 &
pid1=$!
wait $pid0
deadline=$((t_start + ${GPU1_DEADLINE_S:-900}))
while kill -0 $pid1 2>/dev/null && [ "$(date +%s)" -lt $deadline ]; do sleep 5; done
kill -- -$pid1 2>/dev/null && stage "gpu1 stopped at deadline"
sleep 3
stage B
CUDA_VISIBLE_DEVICES=0 scale one-gpu-b2 --gpus 1 --batch-per-gpu 2
scale fsdp2-b2 --gpus 2 --mesh fsdp=2 --batch-per-gpu 2 --profile /tmp/jt/trace_fsdp
stage C
OUT=/tmp/jt/multihost bash benchmarks/multihost.sh checks > /tmp/jt/multihost.log 2>&1
status multihost-checks $?
stage all-done
