#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU): GRPO at Llama-3-8B shapes, Unsloth + TRL then jaxtune in one hold on the same random
# 4-bit checkpoint and prompts (8 prompts x 8 completions, 256 + 512 tokens, EOS suppressed), each at two batch
# layouts, with the GPU time by kernel class of one step of each side.
# Detached: bash benchmarks/drivers/poll.sh THIS 17 540
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run jaxtune-grpo env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 16x4,8x8 --profile /tmp/jt/trace
run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth profile
run unsloth-grpo-16x4 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 16 4 unsloth
stage all-done
