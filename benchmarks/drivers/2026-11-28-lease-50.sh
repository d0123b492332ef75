#!/usr/bin/env bash
# Hold of 2026-11-28 (nvidia-h200-x4, one call kept warm by polling). Carry .site, .bench and .gguf_site.
# The plan written for the hold before (not run: that session's device time was spent) on GPUs 0-2, and the MoE
# grouped GEMM by JAX's Mosaic GPU ragged dot (wgmma) on GPU 3:
# GPU 0: compiled checks (NF4 byte-permute and weight-first tiles; one layer's loss and LoRA gradients per kernel mode
#   at the 1B and 8B shapes in float32); the GRPO step 8x8 with the rollout reading the base dequantized once
#   (--dense-rollout auto), from the codes per token (off, the default), and auto capped at a 24 GB card.
# GPU 1: Unsloth + TRL's GRPO step (the same-hold ratio); the decode sweep with the permute tiles at 16 and 64 rows,
#   then the GRPO step with its best tiles.
# GPU 2: the 1B QAT runs in float32: the plain run under the three kernel modes (lease 48's spread), q4_0 QAT from
#   step 0, from step 50 and from step 100 of 150, NF4 QAT from step 100 (the recovered fraction of issue 61).
# GPU 3: the wgmma kernel's GPU tests; the grouped GEMM alone (Triton and wgmma tilings) at Qwen3-30B-A3B's and
#   Mixtral-8x7B's shapes; the Qwen3-30B-A3B-shaped step (24 layers) with wgmma and with Triton at batch 16 beside
#   Unsloth's MoE path at its best batch (16, no checkpointing), then wgmma at batch 64.
# Then: benchmarks/ladders/multihost.py cases e, f, g on all four GPUs (make_batches agrees on a refusal across processes).
# bash benchmarks/drivers/poll.sh THIS 50 560   (then poll again for the rest)
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage gpu-checks
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_nf4.py tests/test_gpu_layer_paths.py 2>&1 | tail -40 > /tmp/jt/gpu_tests.log
  status gpu-checks "${PIPESTATUS[0]}"
  G="python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3"
  run jaxtune-grpo-dense env PYTHONPATH=. $G --dense-rollout auto
  run jaxtune-grpo-codes env PYTHONPATH=. $G --dense-rollout off
  run jaxtune-grpo-dense-cap24 env PYTHONPATH=. $G --dense-rollout auto --cap-gib 23.5
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
  G="python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3"
  run nf4-sweep env PYTHONPATH=. python3 benchmarks/kernels/nf4_matmul.py --ms 16,64 --dirs fwd --out /tmp/jt/nf4_table.json
  run jaxtune-grpo-table env PYTHONPATH=. $G --dense-rollout off --nf4-table /tmp/jt/nf4_table.json
}
gpu2() {
  export CUDA_VISIBLE_DEVICES=2
  export PYTHONPATH=.:examples:benchmarks:$here/.gguf_site
  Q="python3 benchmarks/accuracy/qat_random_llama.py --steps 150 --words 512 --dtype float32"
  run f32-auto $Q --base nf4 --formats "" --out /tmp/q50a
  run f32-xla env JAXTUNE_KERNELS=xla $Q --base nf4 --formats "" --out /tmp/q50b
  run f32-pallas env JAXTUNE_KERNELS=pallas $Q --base nf4 --formats "" --out /tmp/q50g
  run qat-1b-q4_0-f32-late100 $Q --base nf4 --formats q4_0 --qat-start-step 100 --out /tmp/q50e
  run qat-1b-nf4-f32-late100 $Q --base bf16 --formats nf4 --qat-start-step 100 --out /tmp/q50f
  run qat-1b-q4_0-f32-late50 $Q --base nf4 --formats q4_0 --qat-start-step 50 --out /tmp/q50h
  run qat-1b-q4_0-f32 $Q --base nf4 --formats q4_0 --out /tmp/q50c
}
gpu3() {
  export CUDA_VISIBLE_DEVICES=3
  stage wgmma-tests
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernel_grouped_wgmma.py tests/test_kernel_grouped.py 2>&1 | tail -30 > /tmp/jt/gpu_tests_wgmma.log
  status wgmma-tests "${PIPESTATUS[0]}"
  run moe-ckpt env PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-30b-a3b --bf16 --layers 24 /tmp/moe30
  run grouped-qwen env PYTHONPATH=. python3 benchmarks/moe/moe_grouped_gemm.py --model qwen3-30b-a3b --tokens 8192 --wgmma
  M="python3 benchmarks/steps/train_qlora.py /tmp/moe30 --remat selective --steps 3 --warmup 1"
  run jt-moe-b16-wgmma env PYTHONPATH=. $M --batch 16 --moe-gemm wgmma
  run unsloth-moe-nockpt env PYTHONPATH=$here/.site python3 benchmarks/moe/unsloth_moe.py /tmp/moe30 16 --ckpt false
  run jt-moe-b16-triton env PYTHONPATH=. $M --batch 16 --moe-gemm triton
  run jt-moe-b64-wgmma env PYTHONPATH=. $M --batch 64 --moe-gemm wgmma
  run grouped-mixtral env PYTHONPATH=. python3 benchmarks/moe/moe_grouped_gemm.py --model mixtral-8x7b --tokens 8192 --only-wgmma
}
queues 1500
stage multihost
CASES=e,f,g multihost_checks
cp /tmp/jt/multihost/*.jsonl /tmp/jt/ 2>/dev/null
stage all-done
