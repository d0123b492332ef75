#!/usr/bin/env bash
# Hold of 2026-11-28, the machine of lease 37 (one H200, checkpoint /tmp/moe30 still there): Unsloth's MoE path
# without gradient checkpointing (its other layout), and jaxtune's batch-16 step profiled by kernel class.
# bash benchmarks/drivers/poll.sh THIS 38 540
set -u
. benchmarks/tools/lease_queue.sh
run unsloth-moe-nockpt env PYTHONPATH=$here/.site python3 benchmarks/moe/unsloth_moe.py /tmp/moe30 8 16 32 --ckpt false
stage jt-moe-b16-profile
PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/moe30 --batch 16 --remat selective --steps 3 --warmup 1 --profile /tmp/jt/prof 2>&1 | tagged jt-moe-b16-profile
run trace-b16 python3 benchmarks/tools/trace_summary.py /tmp/jt/prof 2 25
stage all-done
