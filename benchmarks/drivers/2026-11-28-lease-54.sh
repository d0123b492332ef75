#!/usr/bin/env bash
# Hold 54 (nvidia-h200: one GPU was lent, so the runs go one after another). Carry .site, .bench and .gguf_site.
# Issue 59: the GRPO step with the rollout's dequantized copies of as many leading layers as fit (new), capped at
#   Unsloth + TRL's peak (16.6 GiB) and at a 24 GB card (23.5 GiB), beside Unsloth + TRL in the same hold.
# Issue 60: Mixtral-8x7B shapes (32 layers, 8 experts of 14336, top 2; NF4 ~26 GB) on one GPU: jaxtune's step at
#   batch 1 and 4, Unsloth's MoE path beside it at the same batches.
# bash benchmarks/drivers/poll.sh THIS 54 560   (then poll again within 30 s for the rest)
set -u
. benchmarks/tools/lease_queue.sh
export CUDA_VISIBLE_DEVICES=0
ckpt llama3-8b /tmp/bnb4_8b
G="python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --dense-rollout auto"
run grpo-cap16.5 env PYTHONPATH=. $G --cap-gib 16.5
run unsloth-grpo-8x8 env PYTHONPATH=$here/.site timeout 400 python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
run grpo-cap23.5 env PYTHONPATH=. $G --cap-gib 23.5
rm -rf /tmp/bnb4_8b
run moe-ckpt-mixtral env PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model mixtral-8x7b /tmp/mixtral
M="python3 benchmarks/steps/train_qlora.py /tmp/mixtral --remat selective --steps 3 --warmup 1"
run jt-mixtral-b1 env PYTHONPATH=. $M --batch 1
run jt-mixtral-b4 env PYTHONPATH=. $M --batch 4
run unsloth-mixtral env PYTHONPATH=$here/.site timeout 500 python3 benchmarks/moe/unsloth_moe.py /tmp/mixtral 1 4
stage all-done
# Then, the machine still warm and /tmp/mixtral still on its disk, two more calls (their lines appended to the raw
# file as the runs named below; the second call's runs all ran out of memory, see the results page):
#   M="python3 benchmarks/steps/train_qlora.py /tmp/mixtral --remat selective --steps 3 --warmup 1"
#   run jt-mixtral-b8 env PYTHONPATH=. $M --batch 8;  run jt-mixtral-b16 ... --batch 16;  run jt-mixtral-b32 ... --batch 32
#   run unsloth-mixtral-8-16 env PYTHONPATH=$here/.site python3 benchmarks/moe/unsloth_moe.py /tmp/mixtral 8 16
#   run unsloth-mixtral-nockpt env PYTHONPATH=$here/.site python3 benchmarks/moe/unsloth_moe.py /tmp/mixtral 1 4 8 --ckpt false
#   (second call) train_qlora.py /tmp/mixtral --remat none --batch 4 | 8 | 16: out of memory (543.8 GiB asked at 16)
