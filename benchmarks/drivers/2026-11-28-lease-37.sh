#!/usr/bin/env bash
# Hold of 2026-11-28 (one GPU, one call, nothing else on it): Qwen3-30B-A3B's shapes (24 of its 48 layers: the
# bf16 checkpoint of all 48 is 61 GB, more than the 64 GB disk holds beside the rest), random bf16 weights in the
# hub's per-expert layout, quantized to NF4 on load by both sides. Unsloth's MoE path (its default gradient
# checkpointing, batches up to the first out-of-memory, each batch's last step profiled by kernel class), then
# jaxtune (remat selective) at batches 8, 16, 32.
# bash benchmarks/drivers/poll.sh THIS 37 570
set -u
. benchmarks/tools/lease_queue.sh
run ckpt env PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model qwen3-30b-a3b --bf16 --layers 24 /tmp/moe30
run unsloth-moe env PYTHONPATH=$here/.site python3 benchmarks/moe/unsloth_moe.py /tmp/moe30 2 4 8 16 32 --profile
for b in 16 32 8; do
  jt jt-moe-b$b /tmp/moe30 --batch $b --remat selective --steps 3 --warmup 1
done
stage all-done
