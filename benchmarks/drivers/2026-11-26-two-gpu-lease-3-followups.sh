#!/usr/bin/env bash
# The calls that followed 2026-11-26-two-gpu-lease-3.sh (nvidia-h200-x2), one function per call, run on the GPU
# machine after the driver (hold A) or on a fresh machine (hold B), e.g. `bash ...-followups.sh call3`.
# Lines go to /tmp/jt/r*.jsonl; merged, tagged by hold, in 2026-11-26-70b-parity-fsdp-h200x2.jsonl.
set -u
. benchmarks/tools/run_log.sh
here=$PWD
tag() { json_lines | sed -u "s/^{/{\"run\": \"$1\", /"; }
jt() { local gpu=$1 name=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$@" 2>&1 | tag "$name"; }
unsloth() {  # unsloth GPU NAME CKPT BATCH CHECKPOINTING(False|unsloth)
  local ck=$5; [ "$ck" = unsloth ] && ck="'unsloth'"
  CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$here/.site:$here/.bench python3 -c \
    "from unsloth_baseline import run; run('$3', $4, 2048, $ck)" 2>&1 | tag "$2"
}
a70=(/tmp/bnb4_70b --steps 4 --warmup 2 --warm-autotune)
call3() {  # hold A: the 70B step without offload beside Unsloth's own checkpointing at batch 1
  (for r in selective none; do jt 0 jt70-$r-b1 "${a70[@]}" --batch 1 --remat $r; done
   jt 0 jt70-selective-b2 "${a70[@]}" --batch 2 --remat selective) >> /tmp/jt/r2.jsonl &
  unsloth 1 unsloth70-b1-ckpt /tmp/bnb4_70b 1 unsloth >> /tmp/jt/r2.jsonl & wait
}
call4() {  # hold A: FP8 at 70B; Unsloth batch 2 without checkpointing
  (jt 0 jt70-fp8-selective-b1 "${a70[@]}" --batch 1 --remat selective --compute fp8
   jt 0 jt70-fp8-per-layer-b2 "${a70[@]}" --batch 2 --remat per-layer --compute fp8) >> /tmp/jt/r3.jsonl &
  unsloth 1 unsloth70-b2 /tmp/bnb4_70b 2 False >> /tmp/jt/r3.jsonl & wait
}
call5() {  # hold A: GPU time by class at 70B batch 1 on both sides; Unsloth 32B batch 2 again
  (jt 0 jt70-selective-b1-trace /tmp/bnb4_70b --batch 1 --remat selective --steps 2 --warmup 1 --warm-autotune \
     --profile /tmp/jt/trace70
   python3 benchmarks/tools/trace_summary.py /tmp/jt/trace70 2 25 | sed -u 's/^{/{"run": "jt70-selective-b1-profile", /') >> /tmp/jt/r4.jsonl &
  (CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$here/.site python3 .bench/unsloth_profile.py /tmp/bnb4_70b 1 2>&1 | tag unsloth70-b1-profile
   unsloth 1 unsloth32-b2 /tmp/bnb4_qwen3-32b 2 False) >> /tmp/jt/r4.jsonl & wait
}
hold_b_call1() {  # hold B: XLA's dynamic-slice fusion (GEMMs reading/writing the layer loop's stacks in place)
  F=--xla_gpu_enable_dynamic_slice_fusion=true
  q() { local gpu=$1 m=$2 ck=$3 b=$4 fl
    CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model "$m" "$ck" > /dev/null 2>&1
    for fl in "" "$F"; do
      XLA_FLAGS="$fl" jt "$gpu" "$m-b$b" "$ck" --batch "$b" --remat selective --steps 4 --warmup 2 \
        | sed -u "s/^{/{\"xla_flags\": \"$fl\", /"
    done; }
  q 0 llama3-70b /tmp/bnb4_70b 1 >> /tmp/jt/r5.jsonl & q 1 qwen3-32b /tmp/bnb4_32b 2 >> /tmp/jt/r5.jsonl & wait
}
hold_b_call2() {  # hold B: 70B batch 1, jaxtune and Unsloth at once on the two GPUs
  jt 0 jt70-selective-b1-pair /tmp/bnb4_70b --batch 1 --remat selective --steps 4 --warmup 2 >> /tmp/jt/r6.jsonl &
  unsloth 1 unsloth70-b1-pair /tmp/bnb4_70b 1 False >> /tmp/jt/r6.jsonl & wait
}
"$@"
