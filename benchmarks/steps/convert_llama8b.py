"""Convert time, pre-quantized load time and on-disk bytes of a random Llama-3-8B-shaped checkpoint.

On the GPU machine, from the repository root (each step its own process, so load is measured cold in-process):
    PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py make /tmp/base_llama3-8b     # random bf16 HF checkpoint (torch)
    PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py convert /tmp/base_llama3-8b /tmp/jt-llama3-8b-nf4
    PYTHONPATH=. python3 benchmarks/steps/convert_llama8b.py load /tmp/jt-llama3-8b-nf4
Each step prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import time

T_PROCESS = time.perf_counter()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def make(dst: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if not os.path.exists(os.path.join(dst, "config.json")):
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(dst, safe_serialization=True)
    print(json.dumps({"step": "make", "path": dst, "gb": round(_dir_bytes(dst) / 1e9, 2)}), flush=True)


def convert(src: str, dst: str) -> None:
    import jax

    import jaxtune

    seconds = jaxtune.convert(src, dst, quantize="nf4")
    print(json.dumps({"step": "convert", "device": jax.local_devices()[0].device_kind, "seconds": round(seconds, 1),
                      "gb": round(_dir_bytes(dst) / 1e9, 3), "gib": round(_dir_bytes(dst) / 2**30, 3)}), flush=True)


def load(path: str) -> None:
    import jax
    from flax import nnx

    import jaxtune

    t_import = time.perf_counter() - T_PROCESS
    t0 = time.perf_counter()
    jax.block_until_ready(jax.numpy.zeros(1))  # backend and allocator start-up, reported apart
    t_init = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, _ = jaxtune.from_pretrained(path)
    jax.block_until_ready(nnx.state(model))
    t_load = time.perf_counter() - t0
    arrays = jax.tree.leaves(nnx.state(model))
    nbytes = sum(a.size * a.dtype.itemsize for a in arrays)
    ids = jax.numpy.zeros((1, 16), jax.numpy.int32) + 7
    finite = bool(jax.numpy.isfinite(model(ids)).all())
    print(json.dumps({"step": "load", "load_s": round(t_load, 2), "import_s": round(t_import, 2),
                      "backend_init_s": round(t_init, 2), "process_total_s": round(time.perf_counter() - T_PROCESS, 2),
                      "device_gb": round(nbytes / 1e9, 3), "logits_finite": finite}), flush=True)


if __name__ == "__main__":
    {"make": make, "convert": convert, "load": load}[sys.argv[1]](*sys.argv[2:])
