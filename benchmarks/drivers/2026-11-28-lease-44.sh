#!/usr/bin/env bash
# Hold of 2026-11-28 (nvidia-h200-x2), after lease 43: decoding with a KV cache per layer (one traced layer per
# decoder layer, each reading and writing its own cache arrays: no per-layer slice or whole-cache copies) against the
# stacked cache's layer loop at a GRPO rollout's 64 rows. GPU 0: the decode profile both ways, then the GRPO step at
# Llama-3-8B shapes with per-layer caches (the default on a GPU). GPU 1 at the same time: Unsloth + TRL's GRPO step
# on the same checkpoint and prompts (8x8 completions, 256 + 512 tokens, EOS suppressed), then jaxtune's with the
# stacked cache. Then both GPUs: benchmarks/ladders/multihost.py cases e (a bad dataset on one process), f (GRPO as two
# processes equal to one process driving both GPUs), g (a reward function failing on one process).
# bash benchmarks/drivers/poll.sh THIS 44 570
set -u
. benchmarks/tools/lease_queue.sh
ckpt llama3-8b /tmp/bnb4_8b
gpu0() {
  export CUDA_VISIBLE_DEVICES=0
  run decode-loop env PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --per-layer-cache off --no-trace --label loop
  run decode-per-layer env PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b --per-layer-cache on --trace /tmp/jt/trace-p --label per-layer
  run jaxtune-grpo-8x8 env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  run unsloth-grpo-8x8 env PYTHONPATH=$here/.site python3 benchmarks/rl/unsloth_grpo.py /tmp/bnb4_8b 8 8 unsloth
  run jaxtune-grpo-8x8-loop env PYTHONPATH=. python3 benchmarks/rl/grpo_qlora.py /tmp/bnb4_8b --batches 8x8 --steps 3 --per-layer-cache off
}
two_queues 480
stage multihost
CASES=e,f,g multihost_checks
cp /tmp/jt/multihost/*.jsonl /tmp/jt/ 2>/dev/null
stage all-done
