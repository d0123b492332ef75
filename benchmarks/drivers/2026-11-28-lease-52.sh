#!/usr/bin/env bash
# Next hold (nvidia-h200-x2). Carry .gguf_site (the gguf wheel unpacked).
# GPU 0: where the kernel settings part the 1B runs (lease 50, float32: xla 2.12, pallas 3.70, auto a 4.62 plateau):
#   the new compiled checks first (each layer of a four-layer stack read in place inside a scan by the dequant and
#   fused kernels; a four-layer model's 20-step loss curve under each mode), the one-layer checks, then
#   benchmarks/kernels/gpu_op_check.py --model (a four-layer model, each op swapped for XLA's in turn).
# GPU 1: the plain 1B run's loss curve under xla and auto (where they part), then the recovered fraction with the NF4
#   base under XLA's kernels (what lease 50's q4_0 runs could not show) and NF4 QAT from step 50.
# bash benchmarks/drivers/poll.sh THIS 52 560
set -u
. benchmarks/tools/lease_queue.sh
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage gpu-checks
  JAX_PLATFORMS=cuda python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_gpu_layer_paths.py \
    -k "stack or four_layer" 2>&1 | tail -60 > /tmp/jt/gpu_tests.log
  status gpu-checks "${PIPESTATUS[0]}"
  stage gpu-checks-1layer
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_layer_paths.py \
    -k "not stack and not four_layer" 2>&1 | tail -30 > /tmp/jt/gpu_tests_1layer.log
  status gpu-checks-1layer "${PIPESTATUS[0]}"
  run op-check-model env PYTHONPATH=. python3 benchmarks/kernels/gpu_op_check.py --model
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  export PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  Q="python3 benchmarks/accuracy/qat_random_llama.py --steps 150 --words 512 --dtype float32"
  run curve-xla env JAXTUNE_KERNELS=xla $Q --base nf4 --formats "" --out /tmp/q52x
  run curve-auto $Q --base nf4 --formats "" --out /tmp/q52y
  run curve-bf16base-xla env JAXTUNE_KERNELS=xla $Q --base bf16 --formats "" --out /tmp/q52z
  export JAXTUNE_KERNELS=xla
  run xla-q4_0-late100 $Q --base nf4 --formats q4_0 --qat-start-step 100 --out /tmp/q52a
  run xla-q4_0-late50 $Q --base nf4 --formats q4_0 --qat-start-step 50 --out /tmp/q52b
  run xla-nf4-late50 $Q --base bf16 --formats nf4 --qat-start-step 50 --out /tmp/q52c
  run xla-nf4-late100 $Q --base bf16 --formats nf4 --qat-start-step 100 --out /tmp/q52e
}
queues 1200
stage all-done
