#!/usr/bin/env bash
# Hold of 2026-11-28 (one H200, nothing else on the GPU): decoding with one traced layer per decoder layer (a
# token's step one straight program that CUDA graphs take whole) against the layer loop, at a GRPO rollout's 64
# rows; then the GRPO step at Llama-3-8B shapes, jaxtune (unrolled decoding, its new default on a GPU) and Unsloth +
# TRL on the same random 4-bit checkpoint and prompts (8x8 completions, 256 + 512 tokens, EOS suppressed), and
# jaxtune with the layer loop for the same-hold before/after.
# bash benchmarks/drivers/poll.sh THIS 43 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
run decode-loop env PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --unroll-decode off --no-trace --label loop
run decode-unrolled env PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --unroll-decode on --trace /tmp/jt/trace-u --label unrolled
run jaxtune-grpo-8x8 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
run jaxtune-grpo-8x8-loop env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --unroll-decode off
stage all-done
