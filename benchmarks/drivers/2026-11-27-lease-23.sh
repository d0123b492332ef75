#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call, nothing else on the GPU): Unsloth + TRL GRPO at its larger layout, 16 x 4
# completions (lease 19's attempt overlapped another run), to settle its best batch beside lease 20's 8 x 8.
# bash benchmarks/drivers/poll.sh THIS 23 400
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run unsloth-grpo-16x4 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 16 4 unsloth
stage all-done
