#!/usr/bin/env bash
# Unsloth alone on a random Qwen3.5 checkpoint (written first when missing), its whole log kept: the first step
# compiles Unsloth's patched modeling code and autotunes flash-linear-attention's Triton kernels.
# carry: .site .fla-site .bench ; run from the repository root
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
MODEL=${MODEL:-qwen3.5-9b}; LAYERS=${LAYERS:-16}; CK=/tmp/q35_$MODEL
SITE=$PWD/.site:$PWD/.fla-site
[ -d $CK ] || PYTHONPATH=$PWD:$SITE python3 benchmarks/tools/make_random_hf.py --model $MODEL --layers $LAYERS $CK 2>&1 | grep -v Writing | tee -a "$OUT/make.jsonl"
PYTHONPATH=$SITE:$PWD timeout ${UNSLOTH_S:-500} python3 benchmarks/moe/unsloth_moe.py $CK ${UB:-8} --ckpt ${UCK:-false} --profile > "$OUT/unsloth.jsonl" 2> "$OUT/unsloth.err"
echo "rc $?"; grep -v '^{"system": "unsloth", "linear' "$OUT/unsloth.jsonl" | cut -c1-1500; tail -c 3000 "$OUT/unsloth.err"
