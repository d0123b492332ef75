#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call, nothing else on the GPU): GRPO at Llama-3-8B shapes, jaxtune then
# Unsloth + TRL on the same random 4-bit checkpoint and prompts (8x8 completions, 256 + 512 tokens, EOS
# suppressed); Unsloth's third step profiled by kernel class. (Lease 19's Unsloth lines overlapped another run.)
# bash benchmarks/drivers/poll.sh THIS 20 575
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run jaxtune-grpo-8x8 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth profile
stage all-done
