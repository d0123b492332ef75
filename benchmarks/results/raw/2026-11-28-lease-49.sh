#!/usr/bin/env bash
# Next hold (nvidia-h200-x2; not run on 2026-11-28: that session's device time was spent). Carry .gguf_site (the gguf
# wheel unpacked: `pip download --no-deps gguf==0.19.0`, unzipped).
# 1. One decoder layer's loss and LoRA gradients compiled on the GPU, each kernel mode against XLA in float32, at the
#    Llama-3.2-1B and 8B layer shapes (tests/test_gpu_layer_paths.py): whether lease 48's spread of the NF4 base's
#    training (xla 0.835, auto 1.567, pallas 3.265) is a kernel's error at the 1B shapes or bf16 rounding.
# 2. Lease 47c's plain run in float32 under the three kernel modes: they must agree there.
# 3. QAT at the 1B shapes in float32: plain LoRA against QAT from step 0 and from step 100 of 150, q4_0 on the NF4
#    base (GPU 0), nf4 on the bf16 base (GPU 1): the recovered fraction of issue 61.
# bash benchmarks/results/raw/poll.sh THIS 49 560   (then poll again for the rest)
set -u
. benchmarks/lease_queue.sh
export PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage layer-path-tests
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_layer_paths.py 2>&1 | tail -30 > /tmp/jt/gpu_tests.log
  status layer-path-tests "${PIPESTATUS[0]}"
  run f32-auto python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32 --base nf4 --formats "" --out /tmp/q49a
  run qat-1b-q4_0-f32 python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32 --base nf4 --formats q4_0 --out /tmp/q49c
  run qat-1b-q4_0-f32-late python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32 --base nf4 --formats q4_0 --qat-start-step 100 --out /tmp/q49e
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  run f32-xla env JAXTUNE_KERNELS=xla python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32 --base nf4 --formats "" --out /tmp/q49b
  run f32-pallas env JAXTUNE_KERNELS=pallas python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32 --base nf4 --formats "" --out /tmp/q49g
  run qat-1b-nf4-f32 python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32 --base bf16 --formats nf4 --out /tmp/q49d
  run qat-1b-nf4-f32-late python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32 --base bf16 --formats nf4 --qat-start-step 100 --out /tmp/q49f
}
two_queues 1500
stage all-done
