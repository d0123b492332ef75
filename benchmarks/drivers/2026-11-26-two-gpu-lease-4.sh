#!/usr/bin/env bash
# Fourth hold of 2026-11-26 (nvidia-h200-x2): the unrolled layer loop (no stacks of saved activations) against the
# loop at 70B, 32B and 8B beside Unsloth, the GPU-only tests, then the 70B FSDP step after "FSDP moves weights, not
# activations", then the two-process checks. Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/drivers/2026-11-26-two-gpu-lease-4.sh > /tmp/jt/log 2>&1 < /dev/null &
# Phase A, two queues (both GPUs busy throughout, so every run has a neighbour). GPU 0: the 70B checkpoint, batch 1
# selective looped and unrolled (traced), Unsloth batch 1 without checkpointing. GPU 1: the Qwen3-32B rung at batch
# 2 the same way, 8B batch 4 both ways, the GPU-only tests. Phase B, both GPUs: 70B per-layer batch 2 per GPU on one
# GPU and with fsdp=2 (traced). Phase C: the two-process checks (resume, auto batch, SIGTERM, SIGKILL).
set -u
. benchmarks/tools/lease_queue.sh
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  ckpt llama3-70b /tmp/bnb4_70b
  a=(/tmp/bnb4_70b --batch 1 --remat selective --steps 6 --warmup 2)
  jt jt70-b1-loop "${a[@]}"
  jt jt70-b1-unrolled "${a[@]}" --unroll-layers --profile /tmp/jt/trace70u
  python3 benchmarks/tools/trace_summary.py /tmp/jt/trace70u 2 25 2>&1 | tagged jt70-b1-unrolled-profile
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
  gpu_tests
}
two_queues "${GPU1_DEADLINE_S:-900}"
stage B
CUDA_VISIBLE_DEVICES=0 scale one-gpu-b2 --gpus 1 --batch-per-gpu 2
scale fsdp2-b2 --gpus 2 --mesh fsdp=2 --batch-per-gpu 2 --profile /tmp/jt/trace_fsdp
stage C
multihost_checks
stage all-done
