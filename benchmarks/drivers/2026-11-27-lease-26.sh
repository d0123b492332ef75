#!/usr/bin/env bash
# Hold of 2026-11-27 (one GPU, one call): jaxtune GRPO 8x8 after the prefill's logits were cut to the last token
# (the peak memory), then the same capped at a 24 GB card's memory (23.5 GiB usable).
# bash benchmarks/drivers/poll.sh THIS 26 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run jaxtune-grpo-8x8 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
run jaxtune-grpo-8x8-cap24 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --cap-gib 23.5
stage all-done
