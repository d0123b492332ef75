#!/usr/bin/env bash
# The second call of hold 52 (GPU 1, while GPU 0 ran the op checks): the plain 1B runs of 150 steps had not left the
# loss plateau (4.6) under XLA's kernels either; the same comparison at 300 steps.
set -u
. benchmarks/tools/lease_queue.sh
export CUDA_VISIBLE_DEVICES=1 JAXTUNE_KERNELS=xla PYTHONPATH=.:examples:benchmarks:$PWD/.gguf_site
Q="python3 benchmarks/accuracy/qat_random_llama.py --steps 300 --words 512 --dtype float32"
run s300-q4_0-late200 $Q --base nf4 --formats q4_0 --qat-start-step 200 --out /tmp/q53a
run s300-nf4-late200 $Q --base bf16 --formats nf4 --qat-start-step 200 --out /tmp/q53b
run s300-q4_0-late100 $Q --base nf4 --formats q4_0 --qat-start-step 100 --out /tmp/q53c
stage all-done
