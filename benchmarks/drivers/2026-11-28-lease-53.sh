#!/usr/bin/env bash
# Hold 53 (nvidia-h200-x4). Carry .gguf_site. Lease 52 found no kernel fault (each layer of a stack read in place,
# a four-layer model's loss curve under each mode: as XLA's); the 1B table task's plain run leaves its 4.6 plateau
# or not by chance at lr 2e-3 (XLA's kernels: 2.12 in lease 50, 4.62 in lease 52). Lower peak rates, 300 steps,
# QAT over the last 100 (default kernels, float32): the recovered fraction per format.
# bash benchmarks/drivers/poll.sh THIS 53 300
set -u
. benchmarks/tools/lease_queue.sh
qat() {  # qat GPU NAME LR BASE FORMAT: plain and QAT (last 100 of 300 steps), each exported and scored
  export CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  run "$2" python3 benchmarks/accuracy/qat_random_llama.py --steps 300 --words 512 --dtype float32 --lr "$3" --base "$4" \
    --formats "$5" --qat-start-step 200 --out "/tmp/q53$1"
}
gpu0() { qat 0 q4_0-lr5e-4 5e-4 nf4 q4_0; }
gpu1() { qat 1 nf4-lr5e-4 5e-4 bf16 nf4; }
gpu2() { qat 2 q4_0-lr1e-3 1e-3 nf4 q4_0; }
gpu3() { qat 3 nf4-lr1e-3 1e-3 bf16 nf4; }
queues 600
stage all-done
