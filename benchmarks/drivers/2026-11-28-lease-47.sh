#!/usr/bin/env bash
# Hold of 2026-11-28 (nvidia-h200-x2), after lease 46: what quantization-aware training recovers at Llama-3.2-1B's
# shapes (benchmarks/accuracy/qat_random_llama.py: a random model of those shapes learns a table by LoRA). GPU 0: the NF4
# base, plain LoRA against --qat q4_0 (the one-pass kernel, now the GPU's default), each exported to a q4_0 GGUF.
# GPU 1 at the same time: the bf16 base, plain LoRA against --qat nf4, each exported to a merged NF4 checkpoint.
# Two table sizes each. The first try (a 128-word table, 300 steps) learned it to a loss of 0.0001, where no export
# loses anything, and lacked the gguf package here; carry .gguf_site (gguf's wheel unpacked).
# Second try (47b): tables of 2048 and 8192 words were not learned in 150 steps (held-out loss ~5: nothing to lose).
# Third (47c): 512 words, 150 steps.
# bash benchmarks/drivers/poll.sh THIS 47c 330
set -u
. benchmarks/tools/lease_queue.sh
export PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  run qat-1b-q4_0-w512 python3 benchmarks/accuracy/qat_random_llama.py --steps 150 --words 512 --base nf4 --formats q4_0 --out /tmp/qat1b-a
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  run qat-1b-nf4-w512 python3 benchmarks/accuracy/qat_random_llama.py --steps 150 --words 512 --base bf16 --formats nf4 --out /tmp/qat1b-b
}
two_queues 320
stage all-done
