#!/usr/bin/env bash
# Sixth hold of 2026-11-26 (nvidia-h200-x2), after RoPE stopped forming a float32 rotate_half copy of q and k.
# GPU 0: same-hold pairs, alternating sides: Llama-3-70B batch 1 (jaxtune selective unrolled, Unsloth without
# checkpointing) twice, the second jaxtune run traced; Qwen3-32B batch 2 likewise; then the VRAM ladder's 40 GB rung
# (both sides). GPU 1: the VRAM ladder's 48 GB rung (both sides), Unsloth's 12 GB lengths between 21,848 and 26,218,
# both sides at 8 GB above what they passed, then the GPU-only tests. Detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/drivers/2026-11-26-two-gpu-lease-6.sh > /tmp/jt/log 2>&1 < /dev/null &
set -u
. benchmarks/tools/lease_queue.sh
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  ckpt llama3-70b /tmp/bnb4_70b
  a=(/tmp/bnb4_70b --batch 1 --remat selective --steps 6 --warmup 2 --unroll-layers)
  jt jt70-b1-unrolled-1 "${a[@]}"
  unsloth unsloth70-b1-1 /tmp/bnb4_70b 1
  jt jt70-b1-unrolled-2 "${a[@]}" --profile /tmp/jt/trace70
  python3 benchmarks/tools/trace_summary.py /tmp/jt/trace70 2 25 2>&1 | tagged jt70-b1-unrolled-profile
  unsloth unsloth70-b1-2 /tmp/bnb4_70b 1
  ckpt qwen3-32b /tmp/bnb4_32b
  b=(/tmp/bnb4_32b --batch 2 --remat selective --steps 6 --warmup 2 --unroll-layers)
  jt jt32-b2-unrolled-1 "${b[@]}"
  unsloth unsloth32-b2-1 /tmp/bnb4_32b 2
  jt jt32-b2-unrolled-2 "${b[@]}"
  unsloth unsloth32-b2-2 /tmp/bnb4_32b 2
  while [ ! -f /tmp/jt/ckpt8-ready ]; do sleep 2; done
  rung unsloth-40 UNSLOTH_SEQS_40=153977,184773
  rung jaxtune-40 JT_SEQS_40=184773,215568
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  ckpt llama3-8b /tmp/bnb4_8b && touch /tmp/jt/ckpt8-ready
  rung jaxtune-48 JT_SEQS_48=230074,268420
  rung unsloth-48 UNSLOTH_SEQS_48=191728,230074
  rung unsloth-12 UNSLOTH_SEQS_12=23000,24000,25000
  rung unsloth-8 UNSLOTH_SEQS_8=4800,5600,6500
  rung jaxtune-8 JT_SEQS_8=6000,7000,8500
  gpu_tests
}
two_queues "${GPU1_DEADLINE_S:-1560}"
stage all-done
