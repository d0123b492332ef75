#!/usr/bin/env bash
# The end-to-end benchmark on one GPU machine, in stages that fit the device tool's 10-minute calls:
#   bash benchmarks/steps/e2e.sh jaxtune   # checkpoint, convert, load, dense batches (+ profile)
#   bash benchmarks/steps/e2e.sh jaxtune2  # automatic batch, variable-length, long sequences
#   bash benchmarks/steps/e2e.sh unsloth   # Unsloth dense + variable-length
#   bash benchmarks/steps/e2e.sh hf        # HF + PEFT + bitsandbytes dense + variable-length
#   bash benchmarks/steps/e2e.sh dense-jaxtune; bash benchmarks/steps/e2e.sh dense-unsloth   # dense step side by side,
#                                    # batches 1/2/4/8, both sides profiled at batch 4 (run back to back)
#   bash benchmarks/steps/e2e.sh dense-cudnn  # plain causal rows: cuDNN vs Pallas attention (then dense-unsloth)
#   bash benchmarks/steps/e2e.sh dense-compute  # bf16 and FP8 projections at batches 1/4/8 (then dense-unsloth)
# Needs .bench (../shared/bench) and .site (its make_site.sh) carried for the baselines; JSON lines go to
# $OUT/e2e-<stage>.jsonl. All stages read /tmp/base_llama3-8b (bf16 random Llama-3-8B shapes).
set -uo pipefail
stage=$1
out=${OUT:-/tmp/out}/e2e-$stage.jsonl
mkdir -p "$(dirname "$out")"
base=/tmp/base_llama3-8b
jt=/tmp/jt8b
run() { echo "+ $*" >&2; local t0=$SECONDS; "$@" 2>>"${out%.jsonl}.err" | grep '^{' | tee -a "$out"; echo "  ($((SECONDS - t0)) s)" >&2; }
jaxtune() { run timeout "${LIMIT:-170}" env PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$jt" "$@"; }
baseline_py() { PYTHONPATH=$PWD/.site:$PWD/.bench HF_HUB_OFFLINE=1 python3 "$@"; }

checkpoint() {
  [ -f $base/config.json ] || run python3 .bench/hf_qlora_baseline.py llama3-8b make
  [ -f $base/tokenizer.json ] || python3 -c "import sys; sys.path.insert(0, '.bench'); from tiny_ckpt import save_tokenizer; save_tokenizer('$base', 128256)"
}

case $stage in
dense-jaxtune)  # the dense-step comparison, jaxtune side: batches 1/2/4/8 at their fastest remat, bs4 profiled
  checkpoint
  [ -d $jt ] || run env PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py convert $base $jt
  jaxtune --batch 1 --remat none --steps 10
  jaxtune --batch 2 --remat none --steps 8
  jaxtune --batch 4 --remat selective --steps 8
  jaxtune --batch 4 --remat none --steps 6
  jaxtune --batch 8 --remat selective --steps 6
  LIMIT=120 run env XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python3 benchmarks/steps/train_qlora.py $jt \
    --batch 4 --remat selective --steps 2 --profile /tmp/trace
  python3 benchmarks/tools/trace_summary.py /tmp/trace 2 60 > "${OUT:-/tmp/out}/profile-jaxtune-bs4.jsonl"
  ;;
dense-cudnn)  # plain causal rows (one sequence per row) through cuDNN vs the same rows through Pallas, then
  # Unsloth at the same batches in the same lease; 50 steps at batch 1 compare the losses of both attentions
  checkpoint
  [ -d $jt ] || run env PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py convert $base $jt
  jaxtune --batch 1 --remat selective --steps 50
  jaxtune --batch 1 --remat selective --steps 50 --data dense-segmented
  jaxtune --batch 4 --remat selective --steps 8
  jaxtune --batch 4 --remat selective --steps 8 --data dense-segmented
  jaxtune --batch 8 --remat selective --steps 6
  LIMIT=120 run env XLA_FLAGS=--xla_gpu_enable_command_buffer= PYTHONPATH=. python3 benchmarks/steps/train_qlora.py $jt \
    --batch 4 --remat selective --steps 2 --profile /tmp/trace
  python3 benchmarks/tools/trace_summary.py /tmp/trace 2 60 > "${OUT:-/tmp/out}/profile-jaxtune-cudnn-bs4.jsonl"
  ;;
dense-compute)  # bf16 and FP8 frozen projections at the same batches (selective remat), for the side-by-side
  # table with Unsloth; BATCHES / COMPUTES narrow it (e.g. BATCHES="1 4" COMPUTES=fp8) to fit a device call
  checkpoint
  [ -d $jt ] || run env PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py convert $base $jt
  for bs in ${BATCHES:-1 4 8}; do for compute in ${COMPUTES:-bf16 fp8}; do
    jaxtune --batch $bs --remat selective --compute $compute --steps $((bs == 1 ? 10 : bs == 4 ? 8 : 6))
  done; done
  ;;
dense-unsloth)  # the same batches through Unsloth (no gradient checkpointing: its fastest), bs4 profiled
  # (BATCHES narrows the batches, PROFILE=0 skips the profile)
  checkpoint
  for bs in ${BATCHES:-1 2 4 8}; do
    run baseline_py -c "import unsloth_baseline as u; u.run('$base', $bs, 2048, False)"
  done
  [ "${PROFILE:-1}" = 0 ] || baseline_py .bench/unsloth_profile.py $base 4 > "${OUT:-/tmp/out}/profile-unsloth-bs4.txt" 2>&1
  ;;
jaxtune)
  checkpoint
  [ -d $jt ] || run env PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py convert $base $jt
  run env PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py load $jt
  jaxtune --batch 1 --remat none
  jaxtune --batch 4 --remat selective --profile /tmp/trace
  python3 benchmarks/tools/trace_summary.py /tmp/trace > "${OUT:-/tmp/out}/profile-bs4-selective.jsonl"
  jaxtune --batch 8 --remat selective
  jaxtune --batch 8 --remat offload
  ;;
jaxtune2)
  jaxtune --batch 2 --remat selective
  jaxtune --data varlen --batch 8 --remat selective
  LIMIT=240 jaxtune --batch auto --remat selective
  for s in 262144 409600; do jaxtune --batch 1 --seq $s --remat offload --compile-only; done
  LIMIT=200 jaxtune --batch 1 --seq 131072 --remat offload --steps 1 --warmup 1
  ;;
unsloth)
  for cfg in "1, False" "4, False" "8, 'unsloth'"; do
    run baseline_py -c "import unsloth_baseline as u; u.run('$base', ${cfg%%,*}, 2048, ${cfg#*, })"
  done
  run baseline_py benchmarks/steps/baselines_varlen.py unsloth $base
  ;;
hf)
  for cfg in "1, False" "4, False" "8, True"; do
    run baseline_py -c "import hf_qlora_baseline as h; h.run('llama3-8b', True, ${cfg%%,*}, 2048, ${cfg#*, })"
  done
  run baseline_py benchmarks/steps/baselines_varlen.py hf $base
  ;;
esac
