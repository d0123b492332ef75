#!/usr/bin/env bash
# Tenth hold of 2026-11-26 (nvidia-h100-x1), after the ninth named the copies of Qwen3-32B's MLP codes (31 ms of a
# 1.12 s step): the dequant kernels now read a stack past 32-bit byte offsets whole as uint16 pairs. The GPU test of
# the 70B-sized stack's last layer (now read as pairs) while both checkpoints are written; Qwen3-32B batch 2 beside
# Unsloth, alternating, with and without XLA's Triton GEMM fusions (the first run profiled: fusion_report.py); the
# 80 GB H100 uncapped at r=32 (defaults); Llama-3-8B batch 4 with and without the Triton GEMM fusions. Detached:
#   bash benchmarks/drivers/poll.sh benchmarks/drivers/2026-11-26-lease-10.sh 10 540
set -u
. benchmarks/tools/lease_queue.sh
C=/tmp/bnb4_qwen3-32b
NO_TRITON="--xla_gpu_enable_triton_gemm=false"
uncapped() {  # uncapped NAME LENGTHS: the longest 8B step at r=32 on the whole GPU (defaults)
  stage "$1"
  PYTHONPATH=. python3 benchmarks/ladders/context_ladder.py /tmp/bnb4_8b --lora-r 32 --remat auto --seqs "$2" 2>&1 | tagged "$1"
  status "$1" "${PIPESTATUS[0]}"
}
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 ckpt qwen3-32b $C ) &
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 ckpt llama3-8b /tmp/bnb4_8b ) &
stage gpu-test-70b-stack
XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_kernel_addressing.py > /tmp/jt/gpu_test.log 2>&1
status gpu-test-70b-stack $?
wait
XLA_FLAGS="--xla_dump_to=/tmp/jt/dump32 --xla_dump_hlo_module_re=.*step.*" \
  jt jt-pairs-1 $C --batch 2 --remat selective --unroll-layers --steps 6 --warmup 2 --profile /tmp/jt/trace32
(cd benchmarks && python3 fusion_report.py /tmp/jt/trace32 /tmp/jt/dump32 2 40 > /tmp/jt/fusions32.jsonl 2> /tmp/jt/fusions32.err)
python3 benchmarks/tools/trace_summary.py /tmp/jt/trace32 2 40 > /tmp/jt/trace32.jsonl 2>&1
rm -rf /tmp/jt/dump32
unsloth unsloth-1 $C 2
XLA_FLAGS=$NO_TRITON jt jt-pairs-no-triton-gemm-1 $C --batch 2 --remat selective --unroll-layers --steps 6 --warmup 2
unsloth unsloth-2 $C 2
jt jt-pairs-2 $C --batch 2 --remat selective --unroll-layers --steps 6 --warmup 2
XLA_FLAGS=$NO_TRITON jt jt-pairs-no-triton-gemm-2 $C --batch 2 --remat selective --unroll-layers --steps 6 --warmup 2
uncapped jaxtune-80-r32 411280
jt jt8-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 6 --warmup 2
XLA_FLAGS=$NO_TRITON jt jt8-b4-no-triton-gemm /tmp/bnb4_8b --batch 4 --remat selective --steps 6 --warmup 2
stage all-done
