#!/usr/bin/env bash
# Hold of 2026-11-27 (one H100, one call): Unsloth + TRL GRPO 8x8 (its best layout, lease 23) beside jaxtune 8x8
# capped at a 24 GB card (23.5 GiB usable) and at 16 GiB, same checkpoint, same prompts.
# bash benchmarks/drivers/poll.sh THIS 27 560   (carry .site and .bench)
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
run jaxtune-grpo-8x8-cap24 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --cap-gib 23.5
run jaxtune-grpo-8x8-cap16 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --cap-gib 16
stage all-done
