#!/usr/bin/env bash
# Llama-3-70B at batch 1 on one GPU machine: the longest executed context of jaxtune and Unsloth on the full
# device and capped at 48 GB, and the batch-1 memory of the seq-2048 step (this tree against .before/, a worktree
# of the previous commit). Long, so it runs detached and is polled:
#   setsid bash benchmarks/ladders/longcontext_70b.sh checkpoint jaxtune-long bs1-memory jaxtune-48 unsloth-48 unsloth-80 \
#     > /tmp/jt/log 2>&1 < /dev/null &
# Stages run in the order given (bs1-memory-after: this tree only; gpu-tests: the -m gpu tests); JSON lines go to
# /tmp/jt/results.jsonl, everything else to the log.
# Unsloth needs .bench/ and .site/ carried (../shared/bench).
set -u
. "$(dirname "$0")/../tools/run_log.sh"
ckpt=/tmp/bnb4_70b
out=/tmp/jt/results.jsonl
here=$PWD
json() { json_lines | tee -a "$out"; }
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
for s in "$@"; do
  stage "$s"
  case "$s" in
    checkpoint) [ -f "$ckpt/config.json" ] || PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-70b "$ckpt" | json ;;
    jaxtune-long) PYTHONPATH=. python3 benchmarks/ladders/context_ladder.py "$ckpt" --seqs 134144 --remat offload | json ;;
    bs1-memory|bs1-memory-after)
      for c in bf16 fp8; do
        [ "$s" = bs1-memory ] && (cd .before && PYTHONPATH=. python3 "$here/benchmarks/steps/train_qlora.py" "$ckpt" \
          --batch 1 --remat per-layer --compute $c --steps 3 --warmup 2 | sed 's/^{/{"tree": "before", /' | json)
        PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$ckpt" --batch 1 --remat per-layer --compute $c --steps 3 \
          --warmup 2 | sed 's/^{/{"tree": "after", /' | json
      done ;;
    jaxtune-48) PYTHONPATH=. python3 benchmarks/ladders/context_ladder.py "$ckpt" --cap-gib 48 --remat offload \
                  --seqs 18432,24576,28672,32768 | json ;;
    unsloth-48) PYTHONPATH=$here/.site python3 benchmarks/ladders/unsloth_context.py "$ckpt" --cap-gib 48 \
                  --seqs 12106,14336,16384,18432,24576 | json ;;
    unsloth-80) PYTHONPATH=$here/.site python3 benchmarks/ladders/unsloth_context.py "$ckpt" --seqs ${UNSLOTH_SEQS:-89389,98304} | json ;;
    gpu-tests) JAX_PLATFORMS=cuda PYTHONPATH=. python3 -m pytest -q -m gpu tests/test_kernel_fp8.py tests/test_kernel_nf4.py \
                 tests/test_kernel_dispatch.py tests/test_train.py tests/test_validation.py 2>&1 | tail -5 ;;
    *) echo "unknown stage $s" ;;
  esac
  echo "--- $s exit statuses: ${PIPESTATUS[*]}" | tee -a /tmp/jt/stages
done
stage done
