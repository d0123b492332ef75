#!/usr/bin/env bash
# The q4_0 quantizer on the GPU: byte-equal to gguf's there too (no fused multiply-add), and its time on
# Llama-3-8B-sized matrices against gguf's numpy quantizer.
set -u
JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/test_quant.py 2>&1 | tail -3
JAX_PLATFORMS=cuda python3 - <<'PY'
import json, time
import numpy as np, jax, gguf
from jaxtune.quant import quantize_q4_0
rng = np.random.default_rng(0)
for shape in [(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]:
    w = rng.standard_normal(shape, dtype=np.float32)
    quantize_q4_0(w)  # compile
    t = time.perf_counter(); ours = quantize_q4_0(w); t_ours = time.perf_counter() - t
    t = time.perf_counter(); ref = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0); t_ref = time.perf_counter() - t
    print(json.dumps({"shape": shape, "device": jax.devices()[0].device_kind, "bytes_equal": bool((ours == ref).all()),
                      "jaxtune_s": round(t_ours, 3), "gguf_numpy_s": round(t_ref, 3)}), flush=True)
PY
