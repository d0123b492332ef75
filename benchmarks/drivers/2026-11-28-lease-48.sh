#!/usr/bin/env bash
# Hold of 2026-11-28 (nvidia-h200-x2), after lease 47c, where plain LoRA at Llama-3.2-1B shapes learned the 512-word
# table to a training loss of 1.567 on the NF4 base but 0.0598 on the bf16 base (same data, steps, seed). The NF4
# base's run again through XLA's reference ops (GPU 1) and through the fused Pallas kernels everywhere (GPU 0).
# bash benchmarks/drivers/poll.sh THIS 48 150
set -u
. benchmarks/tools/lease_queue.sh
export PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  run plain-1b-nf4-pallas env JAXTUNE_KERNELS=pallas python3 benchmarks/accuracy/qat_random_llama.py --steps 150 --words 512 --base nf4 --formats "" --out /tmp/q48a
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  run plain-1b-nf4-xla env JAXTUNE_KERNELS=xla python3 benchmarks/accuracy/qat_random_llama.py --steps 150 --words 512 --base nf4 --formats "" --out /tmp/q48b
}
two_queues 200
stage all-done
