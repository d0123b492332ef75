#!/usr/bin/env bash
# Next hold (nvidia-h200-x2, not yet run). Carry .gguf_site (the gguf wheel unpacked).
# GPU 0: which op parts the kernel settings' 1B runs (lease 50: float32 xla 2.12, pallas 3.70, auto a 4.62 plateau):
#   a four-layer model at the 1B shapes, the training loss, each setting and each op swapped for XLA's in turn; then
#   the compiled layer checks (float32 NF4 tiles of 64 rows past 64 rows, not yet compiled on a GPU).
# GPU 1: the recovered fraction with the NF4 base under XLA's kernels (what lease 50's q4_0 runs could not show).
# bash benchmarks/results/raw/poll.sh THIS 52 560
set -u
. benchmarks/lease_queue.sh
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  run op-check-model env PYTHONPATH=. python3 benchmarks/gpu_op_check.py --model
  stage gpu-checks
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_layer_paths.py 2>&1 | tail -40 > /tmp/jt/gpu_tests.log
  status gpu-checks "${PIPESTATUS[0]}"
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1 JAXTUNE_KERNELS=xla
  export PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  Q="python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32"
  run xla-q4_0-late100 $Q --base nf4 --formats q4_0 --qat-start-step 100 --out /tmp/q52a
  run xla-q4_0-late50 $Q --base nf4 --formats q4_0 --qat-start-step 50 --out /tmp/q52b
  run xla-nf4-late50 $Q --base bf16 --formats nf4 --qat-start-step 50 --out /tmp/q52c
  run xla-q4_0 $Q --base nf4 --formats q4_0 --out /tmp/q52d
}
queues 1200
stage all-done
