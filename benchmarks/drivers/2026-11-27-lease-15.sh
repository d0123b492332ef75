#!/usr/bin/env bash
# Hold of 2026-11-27 (nvidia-h100-x2): the two-process GPU checks (benchmarks/ladders/multihost.py, cases a-e: e is a bad
# dataset on one process), then DPO and ORPO at Llama-3-8B shapes with each side's larger batches too (Unsloth +
# TRL on GPU 0, jaxtune on GPU 1, at the same time, same checkpoint and pairs), so every ratio is best against best.
# Detached: bash benchmarks/drivers/poll.sh THIS 15 540
set -u
export NCCL_NVLS_ENABLE=0
. benchmarks/tools/lease_queue.sh
mkdir -p /tmp/jt
multihost_checks
ckpt llama3-8b /tmp/bnb4_8b
cp /tmp/jt/multihost/multihost.jsonl /tmp/jt/multihost-checks.jsonl 2>/dev/null
gpu0() { CUDA_VISIBLE_DEVICES=0 UNSLOTH_CFGS="2:false 4:false 8:false" bash benchmarks/steps/dpo_vs_unsloth.sh unsloth-dpo unsloth-orpo; }
gpu1() { CUDA_VISIBLE_DEVICES=1 JT_BATCHES=4,8 bash benchmarks/steps/dpo_vs_unsloth.sh jaxtune-dpo jaxtune-orpo;
         CUDA_VISIBLE_DEVICES=1 JT_BATCHES=4 bash benchmarks/steps/dpo_vs_unsloth.sh jaxtune-dpo-fp8; }
two_queues 1500
stage all-done
