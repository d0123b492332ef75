#!/usr/bin/env bash
# Fifth hold of 2026-11-26 (nvidia-h200-x2), after the fourth's machine went back mid-driver (its phase A ran: the
# unrolled layer loop was 1.8-2.4% faster but took 12.7 GiB more at 70B and 18 GiB more at 32B: every layer's weights
# dequantized early). Now each unrolled layer waits for the one before it. Phase A, two queues. GPU 0: the 70B
# checkpoint, batch 1 selective unrolled then looped. GPU 1: the 32B checkpoint, batch 2 unrolled, Unsloth's 70B batch 1
# (same moment as jaxtune's 70B), the GPU-only tests. Phase B: 70B per-layer batch 2 per GPU on one GPU and fsdp=2
# (traced). Phase C: the two-process checks. Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/results/raw/2026-11-26-two-gpu-lease-5.sh > /tmp/jt/log 2>&1 < /dev/null &
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
  ckpt llama3-70b /tmp/bnb4_70b && touch /tmp/jt/ckpt70-ready
  a=(/tmp/bnb4_70b --batch 1 --remat selective --steps 6 --warmup 2)
  jt jt70-b1-unrolled "${a[@]}" --unroll-layers
  jt jt70-b1-loop "${a[@]}"
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  ckpt qwen3-32b /tmp/bnb4_32b
  jt jt32-b2-unrolled /tmp/bnb4_32b --batch 2 --remat selective --steps 6 --warmup 2 --unroll-layers
  while [ ! -f /tmp/jt/ckpt70-ready ]; do sleep 2; done
  unsloth unsloth70-b1 /tmp/bnb4_70b 1
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
deadline=$((t_start + ${GPU1_DEADLINE_S:-420}))
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
