"""Multi-GPU QLoRA throughput: data parallel / FSDP over a (data, fsdp) mesh, random NF4 weights made on device.

On a multi-GPU machine, from the repository root (one process per configuration, so peak memory is its own):
    PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-8b --gpus 2 --mesh data=2 --batch-per-gpu 4
    # the same as 2 processes of one GPU each (README's multi-host launch; --gpus counts every process's GPUs):
    for i in 0 1; do CUDA_VISIBLE_DEVICES=$i JAX_COORDINATOR_ADDRESS=127.0.0.1:1234 JAX_NUM_PROCESSES=2 \
      JAX_PROCESS_ID=$i PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --gpus 2 --mesh data=2 & done; wait
    PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --model llama3-70b --gpus 4 --mesh fsdp=4 --batch-per-gpu 1
    PYTHONPATH=. python3 benchmarks/ladders/scale_qlora.py --batch-per-gpu 1 --seq 131072 --remat offload --warmup 0 --steps 1
Prints one JSON line: tokens/s in all and per GPU, MFU, peak GiB per GPU. Weights are random (the speed of a
QLoRA step does not depend on their values), generated already sharded so a 70B model never sits on one GPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from jaxtune.parallel.distributed import initialize_from_env

initialize_from_env()  # several processes: before anything else touches JAX

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxtune
from benchmarks.steps.train_qlora import dense_batches
from jaxtune.models.config import ModelConfig
from jaxtune.parallel.distributed import peak_memory_gib
from jaxtune.platform.host_info import available_ram_bytes, pinned_cap_bytes
from jaxtune.models.causal_lm import CausalLM
from jaxtune.qlora import quantize_layers
from jaxtune.parallel.sharding import global_batch, make_mesh, shard_state, state_shardings
from jaxtune.training.host_memory import HostMemoryGuard, offload_plan
from jaxtune.training.loop import PEAK_BF16_FLOPS, flops_per_token
from jaxtune.training.step import REMAT_POLICIES, make_optimizer, make_train_step, split_model

MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=2, num_kv_heads=1),  # smoke tests
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
}


def random_model(name: str, mesh):
    cfg = ModelConfig(model_type="llama", vocab_size=128256, head_dim=128, rope_theta=500000.0, **MODELS[name])
    model = nnx.eval_shape(lambda: quantize_layers(CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))))
    graphdef, abstract = nnx.split(model)
    leaves, tree = jax.tree.flatten(abstract)
    shardings = jax.tree.leaves(state_shardings(mesh, abstract))

    def make():
        keys = jax.random.split(jax.random.key(0), len(leaves))
        out = []
        for key, leaf in zip(keys, leaves):
            if jnp.issubdtype(leaf.dtype, jnp.integer):
                out.append(jax.random.randint(key, leaf.shape, 0, 256, jnp.int32).astype(leaf.dtype))
            else:
                out.append((0.02 * jax.random.normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype))
        return out

    state = jax.tree.unflatten(tree, jax.jit(make, out_shardings=shardings)())
    return nnx.merge(graphdef, state)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=list(MODELS))
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--mesh", default=None, help="data=N / fsdp=N / data=A,fsdp=B over the first --gpus devices")
    ap.add_argument("--batch-per-gpu", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--remat", default="selective", choices=list(REMAT_POLICIES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compiling) one")
    ap.add_argument("--aot", action="store_true",
                    help="compile ahead (compile_s and the memory plan printed first), so the first step is run alone; "
                         "with --steps 0 that one step is the measurement (long sequences)")
    ap.add_argument("--offload-device-layers", default="0",
                    help="with --remat offload: the last this many layers keep their inputs in device memory; "
                         "'auto': as many as jaxtune.train keeps for this host's memory")
    ap.add_argument("--offload-group", type=int, default=1,
                    help="with --remat offload: offload one layer input per group of this many layers")
    ap.add_argument("--segments", action="store_true",
                    help="attend through the segment-aware kernel (Pallas) instead of plain causal rows (cuDNN)")
    ap.add_argument("--compute", default="bf16", choices=["bf16", "fp8"], help="frozen projections in bf16 or FP8")
    ap.add_argument("--stop-flag", action="store_true", help="carry the training loop's agreed-stop flag in the batch")
    ap.add_argument("--profile", help="trace 2 more steps to this folder and print GPU time by op class")
    args = ap.parse_args()

    devices = jax.devices()[: args.gpus]
    mesh = make_mesh(args.mesh, devices)
    t0 = time.perf_counter()
    model = random_model(args.model, mesh)
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    model.remat_policy = REMAT_POLICIES[args.remat]
    model.single_sequence_rows = not args.segments  # one sequence per row, as train() attends unpacked rows
    if args.offload_device_layers == "auto":
        host_budget, layouts = offload_plan(model, args.batch_per_gpu, args.seq)
        args.offload_device_layers, args.offload_group = layouts[0]
        if not jax.process_index():
            print(f"offload layout for this host ({host_budget.describe()}): inputs of "
                  f"{args.offload_device_layers} layers on device, group {args.offload_group}", flush=True)
    args.offload_device_layers = int(args.offload_device_layers)
    model.offload_group, model.offload_device_layers = args.offload_group, args.offload_device_layers
    model.compute = args.compute
    build_s = time.perf_counter() - t0
    cfg = jaxtune.TrainConfig(seq_len=args.seq, micro_batch_size=args.batch_per_gpu * args.gpus, max_steps=1000,
                              learning_rate=1e-4, remat=args.remat, compute=args.compute)
    graphdef, lora, frozen = split_model(model)
    optimizer = make_optimizer(cfg)
    lora, frozen, opt_state = (shard_state(mesh, tree) for tree in (lora, frozen, optimizer.init(lora)))
    step_fn = make_train_step(graphdef, cfg, mesh)

    rows = args.batch_per_gpu * args.gpus
    host = dense_batches(rows, args.seq, model.config.vocab_size, 1)[0]
    if args.stop_flag:  # what jaxtune.train adds to every batch: each process's stop request, maxed in the step
        host["stop"] = np.zeros((1, rows, 1), np.int32)
    batch = global_batch(mesh, host)
    compile_s, plan = None, {}
    if args.aot:
        t0 = time.perf_counter()
        compiled = step_fn.compile(lora, opt_state, frozen, batch, jnp.int32(0))
        compile_s = time.perf_counter() - t0
        mem = compiled.compiled.memory_analysis()
        plan = {"planned_device_gib": round((mem.argument_size_in_bytes + mem.output_size_in_bytes
                                             + mem.temp_size_in_bytes - mem.alias_size_in_bytes) / 2**30, 2),
                "planned_host_gib": round(getattr(mem, "host_temp_size_in_bytes", 0) / 2**30, 2)}
        if not jax.process_index():
            print(json.dumps({"seq": args.seq, "compile_s": round(compile_s, 1), **plan}), flush=True)
        step_fn = compiled
    host_before = available_ram_bytes()  # and the guard records how far it falls while steps run (pinned offload)
    host_watch = HostMemoryGuard(interval_s=0.25).start()
    t0 = time.perf_counter()
    lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jnp.int32(0))
    jax.block_until_ready(m)
    first_s = time.perf_counter() - t0
    first_loss = m["loss"]
    for i in range(args.warmup):
        lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jnp.int32(1 + i))
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    losses = []  # device scalars, read after the timed loop
    for i in range(args.steps):
        lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jnp.int32(1 + args.warmup + i))
        losses.append(m["loss"])
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / args.steps if args.steps else first_s
    losses = losses or [first_loss]
    tok_s = rows * args.seq / dt
    if args.profile:
        jax.profiler.start_trace(args.profile)
        for i in range(2):
            lora, opt_state, m = step_fn(lora, opt_state, frozen, batch, jnp.int32(100 + i))
        jax.block_until_ready(m)
        jax.profiler.stop_trace()
    host_watch.stop()
    # LoRA B starts at zero: moved off it = the step updated the adapters (a computation every process joins)
    lora_b_abs_max = float(max(jnp.abs(v).max() for path, v in jax.tree_util.tree_leaves_with_path(lora)
                               if "lora_b" in jax.tree_util.keystr(path)))
    if jax.process_index():
        return
    print(json.dumps({
        "system": "jaxtune", "device": devices[0].device_kind, "model": args.model, "gpus": args.gpus,
        "mesh": dict(mesh.shape), "batch_per_gpu": args.batch_per_gpu, "seq": args.seq, "remat": args.remat,
        "compute": args.compute, "step_s": round(dt, 4), "tok_s": round(tok_s), "tok_s_per_gpu": round(tok_s / args.gpus),
        "mfu": round(tok_s / args.gpus * flops_per_token(model, args.seq) / PEAK_BF16_FLOPS, 3),
        "peak_gib_per_gpu": round(peak_memory_gib() or 0.0, 2), "processes": jax.process_count(),
        "stop_flag": args.stop_flag, "build_s": round(build_s, 1), "first_step_s": round(first_s, 1),
        "compile_s": compile_s and round(compile_s, 1), **plan, "attention": "segments" if args.segments else "plain",
        "offload_group": args.offload_group,
        "offload_device_layers": args.offload_device_layers,
        "host_rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "host_available_before_gib": round(host_before / 2**30, 2),
        "host_available_low_gib": round(min(host_before, host_watch.lowest or host_before) / 2**30, 2),
        "pinned_cap_gib": pinned_cap_bytes() // 2**30,
        "losses": [round(float(x), 5) for x in losses],
        "lora_b_abs_max": lora_b_abs_max,
    }), flush=True)
    if args.profile:
        from benchmarks.tools.trace_summary import main as summarize

        summarize(args.profile)


if __name__ == "__main__":
    main()
