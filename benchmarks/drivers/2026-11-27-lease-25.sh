#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU, one call): the fused NF4 kernel's tiles at 64 rows (a GRPO rollout's decode step) on
# the 8B projection shapes, then the decode profile with those tiles beside the default (dequantize + cuBLAS), and
# with XLA's dynamic-slice fusion (the per-layer KV cache slices).
# bash benchmarks/drivers/poll.sh THIS 25 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b &
run nf4-sweep-m64 env PYTHONPATH=. python3 benchmarks/kernels/nf4_matmul.py --ms 64 --dirs fwd --out /tmp/jt/nf4_m64.json
wait
cp /tmp/jt/nf4_m64.json /tmp/jt/nf4_m64_table.jsonl 2>/dev/null
run decode-fused64 env PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --trace /tmp/jt/trace-f --label fused64 --nf4-table /tmp/jt/nf4_m64.json
run decode-default env PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --trace /tmp/jt/trace-a
run decode-dsfusion env PYTHONPATH=. XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --trace /tmp/jt/trace-d --label dynamic-slice-fusion
stage all-done
