#!/usr/bin/env bash
# Qwen3.5 dense (9B shapes, 8 of 32 layers) beside Unsloth, one hold: the checkpoint written by transformers, Unsloth
# (flash-linear-attention on its path) and jaxtune at a ladder of batches, each profiled by kernel class.
# carry: .site .fla-site .bench ; run from the repository root
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
log() { tee -a "$OUT/$1"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | log env.txt
python3 -c "import torch, transformers, jax; print('torch', torch.__version__, 'transformers', transformers.__version__, 'jax', jax.__version__)" 2>&1 | log env.txt
MODEL=${MODEL:-qwen3.5-9b}; LAYERS=${LAYERS:-8}; CK=/tmp/q35_$MODEL
SITE=$PWD/.site:$PWD/.fla-site
[ -d $CK ] || PYTHONPATH=$PWD:$SITE python3 benchmarks/tools/make_random_hf.py --model $MODEL --layers $LAYERS $CK 2>&1 | grep -v Writing | log make.jsonl
PYTHONPATH=$SITE:$PWD timeout ${UNSLOTH_S:-200} python3 benchmarks/moe/unsloth_moe.py $CK ${UB_NONE:-2 4 8} --ckpt false --profile 2>&1 | grep -E '^\{|Error|error' | log unsloth.jsonl
PYTHONPATH=$SITE:$PWD timeout ${UNSLOTH_CK_S:-120} python3 benchmarks/moe/unsloth_moe.py $CK ${UB_CK:-8 16} --ckpt unsloth 2>&1 | grep -E '^\{|Error|error' | log unsloth.jsonl
PYTHONPATH=$PWD timeout ${JT_S:-300} python3 benchmarks/steps/train_qlora.py $CK --batch ${JB:-4,8,16} --remat ${JREMAT:-selective} --steps 3 --warmup 1 --profile /tmp/trace_jt 2>&1 | grep -E '^\{|Error|error' | log jaxtune.jsonl
for d in /tmp/trace_jt/b*; do echo "{\"trace\": \"$d\", \"summary\": $(PYTHONPATH=$PWD python3 -c "import sys, json; from benchmarks.tools.trace_summary import summarize; print(json.dumps(summarize(sys.argv[1])))" $d)}" | log jaxtune_profile.jsonl; done
true
