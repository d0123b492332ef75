#!/usr/bin/env bash
# Hold 53 (nvidia-h200-x4). Carry .gguf_site. Lease 52 found no kernel fault (each layer of a stack read in place,
# a four-layer model's loss curve under each mode: as XLA's); the 1B table task's plain run leaves its 4.6 plateau
# or not by chance at lr 2e-3 (XLA's kernels: 2.12 in lease 50, 4.62 in lease 52). Lower peak rates, 300 steps,
# QAT over the last 100 (default kernels, float32): the recovered fraction per format.
# bash benchmarks/results/raw/poll.sh THIS 53 300
set -u
. benchmarks/lease_queue.sh
# (the queues' shells get only their gpuN function: each runs the whole command)
gpu0() { export CUDA_VISIBLE_DEVICES=0 PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  run q4_0-lr5e-4 python3 benchmarks/qat_random_llama.py --steps 300 --words 512 --dtype float32 --lr 5e-4 \
    --base nf4 --formats q4_0 --qat-start-step 200 --out /tmp/q53a; }
gpu1() { export CUDA_VISIBLE_DEVICES=1 PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  run nf4-lr5e-4 python3 benchmarks/qat_random_llama.py --steps 300 --words 512 --dtype float32 --lr 5e-4 \
    --base bf16 --formats nf4 --qat-start-step 200 --out /tmp/q53b; }
gpu2() { export CUDA_VISIBLE_DEVICES=2 PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  run q4_0-lr1e-3 python3 benchmarks/qat_random_llama.py --steps 300 --words 512 --dtype float32 --lr 1e-3 \
    --base nf4 --formats q4_0 --qat-start-step 200 --out /tmp/q53c; }
gpu3() { export CUDA_VISIBLE_DEVICES=3 PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  run nf4-lr1e-3 python3 benchmarks/qat_random_llama.py --steps 300 --words 512 --dtype float32 --lr 1e-3 \
    --base bf16 --formats nf4 --qat-start-step 200 --out /tmp/q53d; }
queues 600
stage all-done
