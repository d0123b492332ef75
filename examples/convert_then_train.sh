#!/usr/bin/env bash
# Convert -> train -> export -> generate with the CLI only, on the bundled SmolLM2 and the bundled dataset.
#   bash examples/convert_then_train.sh [OUT_DIR] [STEPS]
set -euo pipefail
out=${1:-runs/cli}
steps=${2:-20}
rm -rf "$out"
jaxtune convert smollm2 "$out/smollm2-nf4" --quantize nf4
jaxtune train --model "$out/smollm2-nf4" --data examples/data/people_train.jsonl --format chat \
  --out "$out/run" --max-steps "$steps" --seq-len 192 --batch-size 4 --lr 1e-3 --lora-r 16 --lora-alpha 32 \
  --dtype float32
jaxtune export "$out/run" --peft "$out/adapter"
jaxtune generate "$out/smollm2-nf4" --adapter "$out/adapter" --dtype float32 --max-new-tokens 48 \
  --prompt "Extract the person as JSON with keys name, age, job, city.
Kofi is a 52-year-old chef who lives in Oslo."
