#!/usr/bin/env bash
# Qwen3-MoE (the suite's tiny config) trained as one process on one GPU and as two processes of one GPU each
# (--mesh data=2), Pallas kernels: the same losses. Then the dense multi-host checks a (resume) and e (a bad dataset
# on one process). Run from the repository root on a 2-GPU machine; JSON lines on stdout.
set -uo pipefail
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p /tmp/moe2p
python3 -c "import sys; sys.path.insert(0, 'tests'); from tiny_tokenizer import save_tiny_tokenizer
save_tiny_tokenizer('/tmp/moe2p/tok')"  # the suite's tokenizer (tests/tiny_tokenizer.py)
opts='{"moe": true, "batch": 8, "steps": 4, "save_steps": 0}'
CUDA_VISIBLE_DEVICES=0 python3 tests/sharded_worker.py train /tmp/moe2p/tok /tmp/moe2p/one "" "$opts" 2>/tmp/moe2p/one.err | grep '^{'
port=$((20000 + RANDOM % 20000))
for i in 0 1; do
  CUDA_VISIBLE_DEVICES=$i JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=$i \
    python3 tests/sharded_worker.py train /tmp/moe2p/tok /tmp/moe2p/two data=2 "$opts" > /tmp/moe2p/p$i.out 2>/tmp/moe2p/p$i.err &
done
wait
grep -h '^{' /tmp/moe2p/p0.out /tmp/moe2p/p1.out || tail -n 25 /tmp/moe2p/p0.err /tmp/moe2p/p1.err
python3 benchmarks/ladders/multihost.py --work /tmp/multihost --cases a,e
