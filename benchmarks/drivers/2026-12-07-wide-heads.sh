#!/usr/bin/env bash
# Flash attention with heads of 256 and 512 (Gemma 4's sliding and full layers, Qwen3.5's full layers) beside XLA
# and cuDNN, tile sweeps, outputs and gradients checked against the XLA reference.
set -uo pipefail
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/env.txt"
run() { PYTHONPATH=$PWD timeout ${KS:-100} python3 benchmarks/kernels/attention.py "$@" 2>&1 | grep -E '^\{' | tee -a "$OUT/wide_heads.jsonl" | cut -c1-400; }
run --seqs 2048,8192 --heads 16,4,512 --sweep-wide --check --no-packed   # Gemma 4 full layers
run --seqs 2048 --heads 32,16,256 --window 1024 --sweep-wide --check     # Gemma 4 sliding layers, packed too
run --seqs 4096 --heads 16,4,256 --check                                  # Qwen3.5 full layers: cuDNN vs wide tiles
true
