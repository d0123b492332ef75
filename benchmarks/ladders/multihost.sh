#!/usr/bin/env bash
# Multi-process training on one host with N GPUs, one process per GPU (README's multi-host launch):
#   bash benchmarks/ladders/multihost.sh checks   # benchmarks/ladders/multihost.py: resume, auto batch, SIGTERM, SIGKILL
#   bash benchmarks/ladders/multihost.sh speed    # Llama-3-8B step: 1 process x N GPUs vs N processes x 1 GPU,
#                                         # and the cost of the agreed-stop flag the training loop adds
# JSON lines go to $OUT (default /tmp/out). NCCL_NVLS_ENABLE=0 stays set in every process.
set -uo pipefail
out=${OUT:-/tmp/out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1
n=$(nvidia-smi -L | grep -c '^GPU ')
scale() { python3 benchmarks/ladders/scale_qlora.py --gpus "$n" --mesh "data=$n" --batch-per-gpu 4 --steps 8 --warmup 2 "$@"; }
case ${1:-checks} in
checks)
  python3 benchmarks/ladders/multihost.py --work /tmp/multihost --cases "${CASES:-a,b,c,d,e}" | tee -a "$out/multihost.jsonl"
  ;;
speed)
  scale | tee -a "$out/scale.jsonl"
  scale --stop-flag | tee -a "$out/scale.jsonl"
  port=$((20000 + RANDOM % 20000))
  for i in $(seq 0 $((n - 1))); do
    CUDA_VISIBLE_DEVICES=$i JAX_COORDINATOR_ADDRESS=127.0.0.1:$port JAX_NUM_PROCESSES=$n JAX_PROCESS_ID=$i \
      scale --stop-flag > "$out/scale-p$i.log" 2>&1 &
  done
  wait
  grep -h '^{' "$out"/scale-p*.log | tee -a "$out/scale.jsonl"
  ;;
esac
