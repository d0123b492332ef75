#!/usr/bin/env bash
# Ninth hold of 2026-11-26 (nvidia-h100-x1): Qwen3-32B shapes at batch 2 (each side's best batch), jaxtune's
# unrolled layer loop (`--unroll-layers`) beside Unsloth without checkpointing, alternating in one hold; the first
# jaxtune run dumps its optimized HLO and is profiled so `fusion_report.py` names its largest non-GEMM kernels;
# one jaxtune variant without XLA's Triton GEMM fusions; Unsloth's per-class profile last. Detached and polled:
#   setsid bash benchmarks/drivers/2026-11-26-lease-9.sh > /tmp/jt/log 2>&1 < /dev/null &
set -u
. benchmarks/tools/lease_queue.sh
C=/tmp/bnb4_qwen3-32b
ckpt qwen3-32b $C
XLA_FLAGS="--xla_dump_to=/tmp/jt/dump32 --xla_dump_hlo_module_re=.*step.*" \
  jt jt-unrolled-1 $C --batch 2 --remat selective --unroll-layers --steps 6 --warmup 2 --profile /tmp/jt/trace32
stage fusion-report
(cd benchmarks && python3 fusion_report.py /tmp/jt/trace32 /tmp/jt/dump32 2 40 > /tmp/jt/fusions32.jsonl 2> /tmp/jt/fusions32.err)
python3 benchmarks/tools/trace_summary.py /tmp/jt/trace32 2 40 > /tmp/jt/trace32.jsonl 2>&1
unsloth unsloth-1 $C 2
jt jt-unrolled-2 $C --batch 2 --remat selective --unroll-layers --steps 6 --warmup 2
unsloth unsloth-2 $C 2
XLA_FLAGS="--xla_gpu_enable_triton_gemm=false" \
  jt jt-unrolled-no-triton-gemm $C --batch 2 --remat selective --unroll-layers --steps 6 --warmup 2
stage unsloth-profile
PYTHONPATH=$here/.site:$here/.bench python3 .bench/unsloth_profile.py $C 2 > /tmp/jt/unsloth_profile32.jsonl 2>&1
status unsloth-profile $?
stage all-done
