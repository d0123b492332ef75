#!/usr/bin/env bash
# Fifth hold of 2026-11-26 (nvidia-h200-x2), after the fourth's machine went back mid-driver (its phase A ran: the
# unrolled layer loop was 1.8-2.4% faster but took 12.7 GiB more at 70B and 18 GiB more at 32B: every layer's weights
# dequantized early). Now each unrolled layer waits for the one before it. Phase A, two queues. GPU 0: the 70B
# checkpoint, batch 1 selective unrolled then looped. GPU 1: the 32B checkpoint, batch 2 unrolled, Unsloth's 70B batch 1
# (same moment as jaxtune's 70B), the GPU-only tests. Phase B: 70B per-layer batch 2 per GPU on one GPU and fsdp=2
# (traced). Phase C: the two-process checks. Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/drivers/2026-11-26-two-gpu-lease-5.sh > /tmp/jt/log 2>&1 < /dev/null &
set -u
. benchmarks/tools/lease_queue.sh
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
  gpu_tests
}
two_queues "${GPU1_DEADLINE_S:-420}"
stage B
CUDA_VISIBLE_DEVICES=0 scale one-gpu-b2 --gpus 1 --batch-per-gpu 2
scale fsdp2-b2 --gpus 2 --mesh fsdp=2 --batch-per-gpu 2 --profile /tmp/jt/trace_fsdp
stage C
multihost_checks
stage all-done
