"""Compile time and forward throughput of a random Llama-3-8B-shaped model (bf16, XLA reference ops).

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 benchmarks/steps/forward_llama8b.py [--batch 1] [--seq 2048] [--layers 32]
Prints a JSON line per measurement and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.models.config import ModelConfig
from jaxtune.models.causal_lm import CausalLM, abstract_model

LLAMA3_8B = ModelConfig(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
    num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_type="llama3",
    rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192,
    max_position_embeddings=131072,
)


def forward_flops_per_token(cfg: ModelConfig, seq: int) -> float:
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * (cfg.num_heads * d) * 2 + h * (cfg.num_kv_heads * d) * 2 + 3 * h * i
    matmul = 2 * (cfg.num_layers * per_layer + h * cfg.vocab_size)
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * d * seq / 2  # causal: half of QK^T and PV
    return matmul + attention


def random_state(cfg: ModelConfig):
    graphdef = nnx.graphdef(abstract_model(cfg))
    state = jax.jit(lambda: nnx.state(CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))()
    return graphdef, state


def time_fn(fn, *args, iters: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(cfg: ModelConfig, batch: int, seq: int, label: str) -> dict:
    graphdef, state = random_state(cfg)
    ids = jax.random.randint(jax.random.key(1), (batch, seq), 0, cfg.vocab_size, jnp.int32)
    logits_fn = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    hidden_fn = jax.jit(lambda s, x: nnx.merge(graphdef, s).hidden_states(x))
    t0 = time.perf_counter()
    compiled = logits_fn.lower(state, ids).compile()
    compile_s = time.perf_counter() - t0
    t_logits = time_fn(compiled, state, ids)
    t_hidden = time_fn(hidden_fn, state, ids)
    tokens = batch * seq
    flops = forward_flops_per_token(cfg, seq) * tokens
    row = {
        "label": label, "layers": cfg.num_layers, "batch": batch, "seq": seq, "compile_s": round(compile_s, 2),
        "forward_ms": round(t_logits * 1e3, 2), "tokens_per_s": round(tokens / t_logits),
        "tflops": round(flops / t_logits / 1e12, 1),
        "backbone_ms": round(t_hidden * 1e3, 2), "backbone_tokens_per_s": round(tokens / t_hidden),
        "peak_gib": round((jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30, 2),
    }
    print(json.dumps(row), flush=True)
    del state
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32, help="fewer layers: shows compile time does not grow with depth")
    args = ap.parse_args()
    print(json.dumps({"device": jax.local_devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    # one model per process: a second compile in the same process reuses autotuning results and looks faster
    rows = [bench(dataclasses.replace(LLAMA3_8B, num_layers=args.layers), args.batch, args.seq, "llama3-8b shape")]
    print("\n| model | layers | batch x seq | compile s | forward ms | tok/s | TFLOP/s | backbone tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['layers']} | {r['batch']}x{r['seq']} | {r['compile_s']} | {r['forward_ms']} | "
              f"{r['tokens_per_s']:,} | {r['tflops']} | {r['backbone_tokens_per_s']:,} |")


if __name__ == "__main__":
    main()
