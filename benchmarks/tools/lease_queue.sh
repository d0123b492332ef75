# Sourced by the GPU-lease drivers (benchmarks/drivers/*-lease-*.sh from 2026-11-26's fourth hold on), run from
# the checkout: one named run per call, its stage and exit status in /tmp/jt/stages, its JSON lines tagged
# {"run": NAME} in $out; `queues` runs the driver's gpu0, gpu1, ... functions at once, one per GPU.
. benchmarks/tools/run_log.sh
here=${here:-$PWD}
out=${out:-/tmp/jt/results.jsonl}
t_start=${t_start:-$(date +%s)}
stage() { echo "=== $1 $(date +%T)" | tee -a /tmp/jt/stages; }
status() { echo "--- $1 exit $2" | tee -a /tmp/jt/stages /tmp/jt/runs.log; }
tagged() { json_lines | sed -u "s/^{/{\"run\": \"$1\", /" | tee -a "$out"; }
run() {  # run NAME COMMAND...: one run, its JSON lines tagged
  local name=$1; shift
  stage "$name"; "$@" 2>&1 | tagged "$name"; status "$name" "${PIPESTATUS[0]}"
}
jt() {  # jt NAME train_qlora-arguments...
  local name=$1; shift
  stage "$name"; PYTHONPATH=. python3 benchmarks/steps/train_qlora.py "$@" 2>&1 | tagged "$name"; status "$name" "${PIPESTATUS[0]}"
}
unsloth() {  # unsloth NAME CKPT BATCH: Unsloth without gradient checkpointing at seq 2048
  stage "$1"
  PYTHONPATH=$here/.site:$here/.bench python3 -c "import sys; from unsloth_baseline import run; run(sys.argv[1], int(sys.argv[2]), 2048, False)" \
    "$2" "$3" 2>&1 | tagged "$1"
  status "$1" "${PIPESTATUS[0]}"
}
scale() {  # scale NAME scale_qlora-arguments...: the 70B-shaped step with per-layer recompute
  local name=$1; shift
  stage "$name"
  PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --remat per-layer "$@" 2>&1 | tagged "$name"
  status "$name" "${PIPESTATUS[0]}"
}
ckpt() {  # ckpt MODEL DIR: a random bitsandbytes-4bit checkpoint
  stage "ckpt-$1"; PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model "$1" "$2" 2>&1 | tagged "ckpt-$1"
}
rung() {  # rung STAGE [VAR=LENGTHS]: one stage of benchmarks/ladders/vram_ladder.sh (jaxtune-GB, unsloth-GB) on the 8B checkpoint
  local s=$1; shift
  env CKPT=/tmp/bnb4_8b "$@" bash benchmarks/ladders/vram_ladder.sh "$s" > "/tmp/jt/ladder-$s.log" 2>&1
}
gpu_tests() {  # the GPU-only tests (from the files that hold them: some import what the GPU machine lacks)
  stage gpu-tests
  JAX_PLATFORMS=cuda python3 -m pytest -q -m gpu -p no:cacheprovider $(grep -l mark.gpu tests/test_*.py) 2>&1 \
    | tail -30 > /tmp/jt/gpu_tests.log
  status gpu-tests "${PIPESTATUS[0]}"
}
multihost_checks() {  # two processes, one GPU each: resume, auto batch, SIGTERM, SIGKILL
  stage multihost-checks
  OUT=/tmp/jt/multihost bash benchmarks/ladders/multihost.sh checks > /tmp/jt/multihost.log 2>&1
  status multihost-checks $?
}
two_queues() { queues "$@"; }  # the drivers of two-GPU holds: gpu0 and gpu1 at once
queues() {  # queues SECONDS: the driver's gpu0 .. gpuN-1 functions at once (as many as it defines, GPUs the machine
  # has); gpu0 in this shell, the others each in a new shell with the driver's functions (define their variables
  # inside them); those still running SECONDS after t_start are stopped
  stage A
  local i pids=() n
  n=$(nvidia-smi -L | grep -c '^GPU ')
  gpu0 > /tmp/jt/gpu0.log 2>&1 &
  local pid0=$!
  for ((i = 1; i < n; i++)); do
    declare -F "gpu$i" > /dev/null || continue
    setsid bash -c "here=$here out=$out; . benchmarks/tools/lease_queue.sh; $(declare -f); gpu$i" > "/tmp/jt/gpu$i.log" 2>&1 &
    pids+=($!)
  done
  wait $pid0
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ "$(date +%s)" -lt $((t_start + $1)) ]; do sleep 5; done
    kill -- -"$pid" 2>/dev/null && stage "queue $pid stopped at deadline"
  done
  sleep 3
}
