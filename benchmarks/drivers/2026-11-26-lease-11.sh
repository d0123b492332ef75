#!/usr/bin/env bash
# Eleventh hold of 2026-11-26 (nvidia-h100-x1). The tenth showed the copies gone with pairs but the dequant kernel
# 40% slower (bytes rebuilt from pairs in registers). nf4_dequant_stacked.py times each way of reading pairs on
# Qwen3-32B's MLP shapes (while the checkpoint is written), the faster of "planes" / "bytes" then runs the 32B step
# (batch 2, unrolled) beside Unsloth, alternating, with and without XLA's Triton GEMM fusions; Llama-3-8B batch 4
# with and without them. Detached: bash benchmarks/drivers/poll.sh benchmarks/drivers/2026-11-26-lease-11.sh 11 540
set -u
. benchmarks/tools/lease_queue.sh
C=/tmp/bnb4_qwen3-32b
NO_TRITON="--xla_gpu_enable_triton_gemm=false"
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 ckpt qwen3-32b $C ) &
stage dequant-stacked
XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 PYTHONPATH=. python3 benchmarks/kernels/nf4_dequant_stacked.py 2>&1 | tagged dequant-stacked
status dequant-stacked "${PIPESTATUS[0]}"
wait
U=$(python3 -c "
import json
rows = [json.loads(l) for l in open('$out') if '\"dequant-stacked\"' in l and '\"us\"' in l and 'gate' in l]
t = {r['variant']: r['us'] for r in rows}
print('bytes' if t.get('pairs: bytes rebuilt', 1e9) < t.get('pairs: planes interleaved', 1e9) else 'planes')")
stage "pairs-unpack $U"
A="--batch 2 --remat selective --unroll-layers --steps 6 --warmup 2 --pairs-unpack $U"
XLA_FLAGS="--xla_dump_to=/tmp/jt/dump32 --xla_dump_hlo_module_re=.*step.*" jt jt-pairs-1 $C $A --profile /tmp/jt/trace32
(cd benchmarks && python3 fusion_report.py /tmp/jt/trace32 /tmp/jt/dump32 2 40 > /tmp/jt/fusions32.jsonl 2> /tmp/jt/fusions32.err)
python3 benchmarks/tools/trace_summary.py /tmp/jt/trace32 2 40 > /tmp/jt/trace32.jsonl 2>&1
rm -rf /tmp/jt/dump32
unsloth unsloth-1 $C 2
XLA_FLAGS=$NO_TRITON jt jt-pairs-no-triton-gemm-1 $C $A
unsloth unsloth-2 $C 2
jt jt-pairs-2 $C $A
XLA_FLAGS=$NO_TRITON jt jt-pairs-no-triton-gemm-2 $C $A
rm -rf $C
( XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 ckpt llama3-8b /tmp/bnb4_8b )
jt jt8-b4 /tmp/bnb4_8b --batch 4 --remat selective --steps 6 --warmup 2
XLA_FLAGS=$NO_TRITON jt jt8-b4-no-triton-gemm /tmp/bnb4_8b --batch 4 --remat selective --steps 6 --warmup 2
stage all-done
