#!/usr/bin/env bash
# One two-GPU lease for the 70B and VRAM-ladder work, detached and polled (copy /tmp/jt back on every poll):
#   setsid bash benchmarks/lease_two_gpus.sh > /tmp/jt/log 2>&1 < /dev/null &
# Phase A, two queues at once: GPU 0 the 70B batch-1 step (plan, checkpoint, jaxtune offload and per-layer, Unsloth,
# FP8, the one-GPU scale baseline); GPU 1 the VRAM ladder's 8-24 GB caps, then the 32B rung.
# Phase B, both GPUs: the 70B step over fsdp=2 and data=2. Phase C, two queues: the 40 and 48 GB caps.
set -u
mkdir -p /tmp/jt
here=$PWD
out=/tmp/jt/results.jsonl
json() { tee -a /tmp/jt/runs.log | grep --line-buffered '^{"' | sed -u "s/^{/{\"run\": \"$1\", /" | tee -a "$out"; }
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  stage plan70; PYTHONPATH=. python3 benchmarks/steps/step_memory.py --model llama3-70b --batch 1 --remat offload per-layer 2>&1 | json plan70
  stage ckpt70; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-70b /tmp/bnb4_70b 2>&1 | json ckpt70
  for r in offload per-layer; do
    stage jt70-$r; PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/bnb4_70b --batch 1 --remat $r --steps 4 --warmup 2 2>&1 | json jt70-$r
  done
  stage unsloth70; PYTHONPATH=$here/.site:$here/.bench python3 -c "from unsloth_baseline import run; run('/tmp/bnb4_70b', 1, 2048, 'unsloth')" 2>&1 | json unsloth70
  stage jt70-fp8; PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/bnb4_70b --batch 1 --remat per-layer --compute fp8 --steps 4 --warmup 2 2>&1 | json jt70-fp8
  stage scale70-1; PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --gpus 1 --batch-per-gpu 1 --remat per-layer 2>&1 | json scale70-1
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  bash benchmarks/ladders/vram_ladder.sh checkpoint jaxtune-8 unsloth-8 jaxtune-12 unsloth-12 jaxtune-16 unsloth-16 jaxtune-24 unsloth-24
  stage 32b; JT_BATCHES="1 2" FP8_BATCH=2 UNSLOTH_CFGS="2:False" bash benchmarks/ladders/size_ladder.sh qwen3-32b
}
stage A; gpu0 > /tmp/jt/gpu0.log 2>&1 & gpu1 > /tmp/jt/gpu1.log 2>&1 & wait
stage B
for m in fsdp=2 data=2; do
  stage scale70-$m; PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --gpus 2 --mesh $m --batch-per-gpu 1 --remat per-layer 2>&1 | json scale70-$m
done
stage C
(export CUDA_VISIBLE_DEVICES=0 JT_SEQS_40=$(( (153977*120+99)/100 )),$(( (153977*140+99)/100 )) JT_SEQS_48=$(( (191728*120+99)/100 )),$(( (191728*140+99)/100 ))
 bash benchmarks/ladders/vram_ladder.sh jaxtune-40 jaxtune-48 > /tmp/jt/gpu0c.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 UNSLOTH_SEQS_40=153977,$(( (153977*120+99)/100 )) UNSLOTH_SEQS_48=191728,$(( (191728*120+99)/100 ))
 bash benchmarks/ladders/vram_ladder.sh unsloth-40 unsloth-48 > /tmp/jt/gpu1c.log 2>&1) &
wait
stage done
