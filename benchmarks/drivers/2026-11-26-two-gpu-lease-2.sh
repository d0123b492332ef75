#!/usr/bin/env bash
# Second hold of 2026-11-26 (nvidia-h200-x2), after the 32-bit offset fix: GPU 0 the kernel probe (the 70B q_proj
# stack read in place vs one layer at a time), the GPU test, then the 70B batch-1 offload step compiled before and
# after the weights load; GPU 1 the 32B rung's jaxtune runs (batch 1 had failed with an illegal address).
#   setsid bash benchmarks/drivers/2026-11-26-two-gpu-lease-2.sh > /tmp/jt/log 2>&1 < /dev/null &
set -u
. benchmarks/tools/run_log.sh
out=/tmp/jt/results.jsonl
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
status() { echo "--- $1 exit $2" | tee -a /tmp/jt/stages /tmp/jt/runs.log; }
tagged() { json_lines | sed -u "s/^{/{\"run\": \"$1\", /" | tee -a "$out"; }
jt() {  # jt NAME train_qlora-arguments...
  local name=$1; shift
  stage "$name"; PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$@" 2>&1 | tagged "$name"; status "$name" "${PIPESTATUS[0]}"
}
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  for g in --unguarded ""; do
    stage "probe$g"; PYTHONPATH=. python3 benchmarks/kernels/kernel_offsets.py $g 2>&1 | tagged "probe$g"; status "probe$g" "${PIPESTATUS[0]}"
  done
  stage gpu-test; python3 -m pytest -q tests/test_kernel_addressing.py 2>&1 | tail -3 | tee -a /tmp/jt/stages
  stage ckpt70; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-70b /tmp/bnb4_70b 2>&1 | tagged ckpt70
  a70=(/tmp/bnb4_70b --batch 1 --remat offload --steps 4 --warmup 2)
  jt jt70-off-compile-first "${a70[@]}" --compile-first
  jt jt70-off "${a70[@]}"
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  stage ckpt32; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-32b /tmp/bnb4_qwen3-32b 2>&1 | tagged ckpt32
  jt jt32-b1 /tmp/bnb4_qwen3-32b --batch 1 --remat selective
  jt jt32-b2 /tmp/bnb4_qwen3-32b --batch 2 --remat selective
  jt jt32-fp8-b2 /tmp/bnb4_qwen3-32b --batch 2 --remat selective --compute fp8
}
gpu0 > /tmp/jt/gpu0.log 2>&1 & gpu1 > /tmp/jt/gpu1.log 2>&1 & wait
stage all-done
