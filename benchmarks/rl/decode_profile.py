"""Where a GRPO rollout's decode step spends its time, on a bnb-4bit checkpoint (benchmarks/tools/make_bnb4_checkpoint.py).

    PYTHONPATH=. python3 benchmarks/rl/decode_profile.py /tmp/bnb4_8b [--rows 64] [--trace DIR]
The rollout's sampler (`jaxtune.rl.rollout.sample`, NF4 base + LoRA r=16, EOS never sampled) on ROWS prompts of
256 tokens x 512 new ones, timed at temperature 1 and greedy; one decode step alone (jit of one token on a cache
filled to the mean context) timed outside the loop; then traces of 8 and 40 new tokens, whose difference is 32 decode
steps: GPU busy time against wall time, kernels per token, the top kernels by GPU time per token. One JSON line each.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


FIRST_CALL_S: list[float] = []  # each timed function's first call (compilation and one run)


def timed(fn, reps: int = 1) -> float:
    t0 = time.perf_counter()
    fn()  # compile
    FIRST_CALL_S.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def busy_ms(events) -> float:
    """Union of the kernels' intervals (ms): the time the GPU ran anything."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events)
    total, end = 0.0, -1.0
    for s, e in spans:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e3


def use_fused_tiles(path: str) -> None:
    """Decode rows (5-16 and 17-64, forward) through the fused NF4 kernel, each weight shape with its sweep's best
    tile at 16 and at 64 rows (`benchmarks/kernels/nf4_matmul.py --ms 16,64 --dirs fwd --out PATH`)."""
    import importlib

    from jaxtune.ops import dispatch
    from pallas_kernels.nf4_matmul import MatmulTiles

    best = {(r["M"], r["N"], r["K"]): MatmulTiles(**r["best_fused"]) for r in json.load(open(path))
            if r["dir"] == "fwd" and r["M"] in (16, 64) and r.get("best_fused")}
    nf4_linear = importlib.import_module("jaxtune.ops.nf4_linear")  # the package exports a function of that name
    default = nf4_linear.kernel_tiles

    def kernel_tiles(m, direction, shape=None):
        rows = 16 if 4 < m <= 16 else 64 if 16 < m <= 64 else None
        if direction == "fwd" and (rows, *(shape or ())) in best:
            return best[(rows, *shape)]
        return default(m, direction, shape)

    nf4_linear.kernel_tiles = kernel_tiles
    fused_up_to = 64 if any(m == 64 for m, _, _ in best) else 16
    dispatch.NF4_TABLE = ((fused_up_to, "fused"), (float("inf"), "dequant+dot"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--trace", default="/tmp/decode_trace")
    ap.add_argument("--label", default="default")
    ap.add_argument("--no-trace", action="store_true", help="time the sampler and one step only")
    ap.add_argument("--nf4-table", help="benchmarks/kernels/nf4_matmul.py --out JSON: up to 64 rows forward take the fused "
                                        "kernel with its fastest tile per weight shape (else dequantize + cuBLAS)")
    ap.add_argument("--per-layer-cache", choices=("auto", "on", "off"), default="auto",
                    help="decode with a KV cache per layer, one traced layer each (auto: on a GPU), or the layer loop")
    args = ap.parse_args()
    import importlib

    decoding = importlib.import_module("jaxtune.generate")  # the package exports a function of that name
    decoding.PER_LAYER_CACHE = {"auto": None, "on": True, "off": False}[args.per_layer_cache]
    if args.nf4_table:
        use_fused_tiles(args.nf4_table)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxtune
    from jaxtune.generate import cache_length
    from jaxtune.models.causal_lm import KVCache
    from jaxtune.rl.rollout import sample
    from benchmarks.tools.trace_summary import _gpu_events, classify

    model, _ = jaxtune.from_pretrained(args.model, load_in_4bit=True)
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    kind = jax.local_devices()[0].device_kind
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(10, model.config.vocab_size, (args.rows, args.prompt)), jnp.int32)
    pad = jnp.zeros((args.rows,), jnp.int32)
    per_layer = decoding.per_layer_cache(jax.default_backend() == "gpu")  # as the rollout chooses
    eos = (int(model.config.eos_token_id),) if isinstance(model.config.eos_token_id, int) else (0,)

    def rollout(new_tokens: int, temperature: float):
        return lambda: np.asarray(sample(
            graphdef, lora, frozen, ids, pad, jax.random.key(0), max_new_tokens=new_tokens,
            cache_len=cache_length(args.prompt, new_tokens), temperature=temperature, top_p=1.0, top_k=0,
            eos_ids=eos, ignore_eos=True, per_layer=per_layer))

    line = {"label": args.label, "device": kind, "rows": args.rows, "prompt": args.prompt,
            "per_layer_cache": per_layer,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    for name, temperature in (("rollout", 1.0), ("greedy", 0.0)):
        s = timed(rollout(args.completion, temperature))
        line[f"{name}_s"] = round(s, 3)
        line[f"{name}_ms_per_token"] = round(s / args.completion * 1e3, 2)
        line[f"{name}_first_call_s"] = round(FIRST_CALL_S[-1], 1)
    print(json.dumps(line), flush=True)

    # one decode step outside the while loop, the cache half full
    cache_len = cache_length(args.prompt, args.completion)
    mid = args.prompt + args.completion // 2

    @jax.jit
    def one_step(lora, frozen, cache, tok):
        m = nnx.merge(graphdef, lora, frozen)
        m.prepare_for_kernels()
        pos = jnp.full((args.rows, 1), mid, jnp.int32)
        logits, cache = m.forward_with_cache(tok[:, None], pos, jnp.ones((args.rows, 1), jnp.int32), cache,
                                             jnp.int32(mid))
        return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), cache

    cache = KVCache.empty(model.config, args.rows, cache_len, model.dtype, per_layer=per_layer)
    cache = cache._replace(segment_ids=jnp.ones_like(cache.segment_ids))
    tok = ids[:, -1]
    state = {"cache": cache, "tok": tok}

    def step():
        state["tok"], state["cache"] = one_step(lora, frozen, state["cache"], state["tok"])
        state["tok"].block_until_ready()

    s = timed(step, 20)
    print(json.dumps({"label": args.label, "one_step_ms": round(s * 1e3, 2)}), flush=True)

    if args.no_trace:
        return

    # traces of 8 and 40 new tokens: their difference is 32 decode steps without the prefill
    def trace(new_tokens: int):
        run = rollout(new_tokens, 1.0)
        run()
        folder = f"{args.trace}/{new_tokens}"
        t0 = time.perf_counter()
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        run()
        jax.profiler.stop_trace()
        wall = time.perf_counter() - t0
        events = [e for e in _gpu_events(folder)[1] if "dur" in e and "ts" in e]
        ms, count = collections.Counter(), collections.Counter()
        for e in events:
            ms[e.get("name", "")[:100]] += float(e["dur"]) / 1e3
            count[e.get("name", "")[:100]] += 1
        span = (max(float(e["ts"]) + float(e["dur"]) for e in events) - min(float(e["ts"]) for e in events)) / 1e3
        return {"wall": wall * 1e3, "span": span, "busy": busy_ms(events), "n": len(events)}, ms, count

    (a, ms_a, n_a), (b, ms_b, n_b) = trace(8), trace(40)
    per_token = {k: (b[k] - a[k]) / 32 for k in a}
    by_kernel = collections.Counter({k: (ms_b[k] - ms_a.get(k, 0.0)) / 32 for k in ms_b})
    by_class = collections.Counter()
    for k, v in by_kernel.items():
        by_class[classify(k)] += v
    print(json.dumps({"label": args.label, "per_token_wall_ms": round(per_token["wall"], 3),
                      "per_token_gpu_span_ms": round(per_token["span"], 3),
                      "per_token_gpu_busy_ms": round(per_token["busy"], 3),
                      "per_token_kernel_sum_ms": round(sum(by_kernel.values()), 3),
                      "kernels_per_token": round(per_token["n"], 1),
                      "class_ms_per_token": {k: round(v, 3) for k, v in by_class.most_common()}}), flush=True)
    for name, ms in by_kernel.most_common(30):
        print(json.dumps({"label": args.label, "kernel": name, "ms_per_token": round(ms, 4),
                          "per_token": round((n_b[name] - n_a.get(name, 0)) / 32, 1)}), flush=True)

if __name__ == "__main__":
    main()
