#!/usr/bin/env bash
# Hold of 2026-11-28 (nvidia-h200-x2), eleventh session. GPU 0: the NF4 forward kernel with the decoded weight tile as
# the dot's left operand (wgmma's register operand) at decoding's 16 and 64 rows, compiled against float64 numpy,
# then swept against dequantize + cuBLAS on the 8B shapes; the GRPO step at 8B shapes with the sweep's best tiles
# for the rollout's 64 rows, then the default; then capped at a 24 GB card (23.5 GiB). GPU 1 at the same time: the
# QAT q4_0 kernel per 8B shape, the 8B step plain / --qat q4_0 --qat-kernel / --qat q4_0 (XLA) (if the kernel's
# step is within 15% of plain, QAT_KERNEL_ON_GPU = True), then Unsloth + TRL's GRPO step (8x8) on the same checkpoint.
# bash benchmarks/drivers/poll.sh THIS 46 570   (then poll again for the rest)
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage nf4-gpu-tests
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_nf4.py 2>&1 | tail -30 > /tmp/jt/gpu_tests.log
  status nf4-gpu-tests "${PIPESTATUS[0]}"
  run nf4-sweep env PYTHONPATH=. python3 benchmarks/kernels/nf4_matmul.py --ms 16,64 --dirs fwd --out /tmp/jt/nf4_table.json
  run jaxtune-grpo-table env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --nf4-table /tmp/jt/nf4_table.json
  run jaxtune-grpo-default env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
  run jaxtune-grpo-table-cap24 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --cap-gib 23.5 --nf4-table /tmp/jt/nf4_table.json
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  run qat-kernel env PYTHONPATH=. python3 benchmarks/kernels/qat_q4_0.py
  jt jt-plain /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1
  jt jt-qat-kernel /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0 --qat-kernel
  jt jt-qat-xla /tmp/bnb4_8b --batch 4 --remat selective --steps 4 --warmup 1 --qat q4_0
  run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
}
two_queues 1500
cp /tmp/jt/nf4_table.json /tmp/jt/gpu_tests.log /tmp/jt/ 2>/dev/null
stage all-done
