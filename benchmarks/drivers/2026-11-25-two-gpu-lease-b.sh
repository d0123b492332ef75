#!/usr/bin/env bash
# The second two-GPU lease: the 70B step over fsdp=2 and data=2 (both GPUs), then at once: GPU 1 Unsloth's 24 GB
# rung of the VRAM ladder, GPU 0 train_qlora.py runs that ended silently before (exit status and faulthandler kept).
set -u
export PYTHONFAULTHANDLER=1
mkdir -p /tmp/jt
here=$PWD
out=/tmp/jt/results.jsonl
json() { tee -a /tmp/jt/runs.log | grep --line-buffered '^{"' | sed -u "s/^{/{\"run\": \"$1\", /" | tee -a "$out"; }
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
CUDA_VISIBLE_DEVICES=1 bash benchmarks/ladders/vram_ladder.sh checkpoint
for m in fsdp=2 data=2; do
  stage scale70-$m; PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --gpus 2 --mesh $m --batch-per-gpu 1 --remat per-layer 2>&1 | json scale70-$m
done
(export CUDA_VISIBLE_DEVICES=1 UNSLOTH_SEQS_24=78475,94170,109865; bash benchmarks/ladders/vram_ladder.sh unsloth-24 > /tmp/jt/gpu1.log 2>&1) &
(export CUDA_VISIBLE_DEVICES=0
 for a in "--remat per-layer" "--remat selective" "--remat per-layer --compute fp8" "--remat per-layer"; do
   stage "jt8 $a"; PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/bnb4_8b --batch 1 --steps 3 --warmup 1 $a 2>&1 | json "jt8 $a"
   echo "--- jt8 $a exit ${PIPESTATUS[0]}" | tee -a /tmp/jt/stages
 done) > /tmp/jt/gpu0.log 2>&1 &
wait
stage done
