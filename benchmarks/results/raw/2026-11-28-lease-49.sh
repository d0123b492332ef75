#!/usr/bin/env bash
# Next hold (nvidia-h200-x2; not run on 2026-11-28: that session's device time was spent). Carry .site, .bench and
# .gguf_site (the gguf wheel unpacked: `pip download --no-deps gguf==0.19.0`, unzipped).
# GPU 0:
# 1. Compiled checks: the NF4 kernels' byte-permute tiles (lut="permute": bf16 tables per (row, block) read by inline
#    PTX) and weight-first tiles against float64; one decoder layer's loss and LoRA gradients per kernel mode against
#    XLA's at the 1B and 8B layer shapes (tests/test_gpu_layer_paths.py), for lease 48's spread.
# 2. The GRPO step with the rollout reading the base dequantized once (--dense-rollout auto: where it fits), then
#    from the codes per token (the default until measured), then auto capped at a 24 GB card (it must fall back).
#    If auto is faster, set jaxtune/rl/rollout.py's DENSE_ROLLOUT = None.
# 3. The decode sweep at 16 and 64 rows with the permute tiles; the GRPO step with its best tiles.
# GPU 1 at the same time: Unsloth + TRL's GRPO step (the same-hold ratio), then lease 47c's plain run in float32
# under the three kernel modes (they must agree there), then QAT at the 1B shapes in float32 from step 0 and from
# step 100 of 150 (the recovered fraction of issue 61).
# Then both GPUs: benchmarks/multihost.py cases e, f, g again (make_batches now agrees on a refusal across processes).
# bash benchmarks/results/raw/poll.sh THIS 49 560   (then poll again for the rest)
set -u
. benchmarks/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage gpu-checks
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_nf4.py tests/test_gpu_layer_paths.py 2>&1 | tail -40 > /tmp/jt/gpu_tests.log
  status gpu-checks "${PIPESTATUS[0]}"
  G="python3 benchmarks/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3"
  run jaxtune-grpo-dense env PYTHONPATH=. $G --dense-rollout auto
  run jaxtune-grpo-codes env PYTHONPATH=. $G --dense-rollout off
  run jaxtune-grpo-dense-cap24 env PYTHONPATH=. $G --dense-rollout auto --cap-gib 23.5
  run nf4-sweep env PYTHONPATH=. python3 benchmarks/nf4_matmul.py --ms 16,64 --dirs fwd --out /tmp/jt/nf4_table.json
  run jaxtune-grpo-table env PYTHONPATH=. $G --dense-rollout off --nf4-table /tmp/jt/nf4_table.json
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
  export PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  Q="python3 benchmarks/qat_random_llama.py --steps 150 --words 512 --dtype float32"
  run f32-auto $Q --base nf4 --formats "" --out /tmp/q49a
  run f32-xla env JAXTUNE_KERNELS=xla $Q --base nf4 --formats "" --out /tmp/q49b
  run f32-pallas env JAXTUNE_KERNELS=pallas $Q --base nf4 --formats "" --out /tmp/q49g
  run qat-1b-q4_0-f32 $Q --base nf4 --formats q4_0 --out /tmp/q49c
  run qat-1b-q4_0-f32-late $Q --base nf4 --formats q4_0 --qat-start-step 100 --out /tmp/q49e
  run qat-1b-nf4-f32-late $Q --base bf16 --formats nf4 --qat-start-step 100 --out /tmp/q49f
}
two_queues 1500
stage multihost
CASES=e,f,g multihost_checks
cp /tmp/jt/multihost/*.jsonl /tmp/jt/ 2>/dev/null
stage all-done
