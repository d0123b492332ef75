#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call: a machine is not kept between calls): Unsloth + TRL GRPO at Llama-3-8B
# shapes on the checkpoint and prompts of lease 17 (8x8 completions, 256 + 512 tokens, EOS suppressed), with the
# GPU time by kernel class of its third step; then jaxtune with the fused NF4 kernel at decode rows up to 64.
# bash benchmarks/drivers/poll.sh THIS 19 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth profile
run jaxtune-grpo-fused64 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --fused-rows 64
stage all-done
