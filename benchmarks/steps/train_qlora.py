"""QLoRA training throughput of jaxtune on a Llama-3-8B-shaped checkpoint (random token ids).

On the GPU machine, from the repository root, after benchmarks/steps/convert_llama8b.py converted the checkpoint:
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/jt8b --batch 4 --remat selective
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/jt8b --batch auto --remat selective
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/jt8b --data varlen --batch 8 --remat selective
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/jt8b --batch 1 --seq 131072 --remat offload --compile-only
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/jt8b --batch 4 --remat selective --profile /tmp/trace
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py /tmp/bnb4_70b --batch 1 --remat offload --compile-first
    PYTHONPATH=. python3 benchmarks/steps/train_qlora.py random:qwen3-30b-a3b --batch 4 --remat selective  # in memory
Prints one JSON line per run: load and first-step seconds, tokens/s (real tokens only for --data varlen, which
packs instruction-like lengths, benchmarks/steps/varlen.py, into rows), MFU (31.6 GFLOP/token-style count over
989 TFLOP/s), peak GiB. Each line carries XLA's memory plan of the step (arguments, temporaries, outputs); --compile-only
reports only that, without running the step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxtune
from jaxtune.data.formats import Example
from jaxtune.data.packing import pack_examples
from jaxtune.parallel.distributed import peak_memory_gib
from jaxtune.ops import dispatch
from jaxtune.training.autobatch import choose_micro_batch
from jaxtune.training.loop import PEAK_BF16_FLOPS, flops_per_token
from jaxtune.training.embedding_offload import embedding_to_host
from jaxtune.training.optimizer_offload import place_on_host
from jaxtune.training.step import REMAT_POLICIES, make_optimizer, make_train_step, split_model


def dense_batches(micro: int, seq: int, vocab: int, count: int) -> list[dict]:
    rng = np.random.default_rng(0)
    shape = (1, micro, seq)
    out = []
    for _ in range(count):
        ids = rng.integers(0, vocab, shape).astype(np.int32)
        labels = np.roll(ids, -1, axis=-1)
        labels[..., -1] = -1
        out.append({"input_ids": ids, "labels": labels, "segment_ids": np.ones(shape, np.int32),
                    "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy()})
    return out


def packed_batches(micro: int, seq: int, vocab: int, count: int) -> tuple[list[dict], float]:
    """Variable-length samples packed into rows (count batches of micro rows) and the packing efficiency."""
    from benchmarks.steps.varlen import sample_sequences

    seqs = sample_sequences(int(count * micro * seq / 250 * 1.2), vocab)
    rows = pack_examples([Example(s, np.ones(len(s), bool)) for s in seqs], seq)
    n = count * micro
    assert len(rows) >= n, "not enough samples for the requested batches"
    out = []
    for i in range(count):
        sl = slice(i * micro, (i + 1) * micro)
        out.append({k: getattr(rows, k)[sl][None] for k in ("input_ids", "labels", "segment_ids", "positions")})
    return out, float((rows.segment_ids[:n] > 0).mean())


def memory_plan(compiled) -> dict:
    """XLA's memory plan of a compiled step in GiB: arguments (frozen weights, LoRA params and optimizer state),
    temporaries (activations, dequantized weights, gradients), outputs not aliased to arguments, and the device
    total; and host temporaries (offloaded layer inputs)."""
    mem = compiled.memory_analysis()
    gib = lambda b: round(b / 2**30, 2)  # noqa: E731
    device = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return {"planned_device_gib": gib(device), "planned_argument_gib": gib(mem.argument_size_in_bytes),
            "planned_temp_gib": gib(mem.temp_size_in_bytes),
            "planned_output_gib": gib(mem.output_size_in_bytes - mem.alias_size_in_bytes),
            "planned_host_gib": gib(getattr(mem, "host_temp_size_in_bytes", 0)),
            # arrays kept in host memory (--offload-optimizer, --offload-embedding), as the plan counts them
            "planned_host_argument_gib": gib(getattr(mem, "host_argument_size_in_bytes", 0)),
            "planned_host_output_gib": gib(getattr(mem, "host_output_size_in_bytes", 0))}


def _peak_gib() -> float:
    """The device's peak bytes in use so far, in GiB: read after loading and after compiling (the GEMM autotuner
    allocates while the weights are resident), it tells which phase sets a run's peak."""
    return round(peak_memory_gib() or 0.0, 2)


def configure(model, args: argparse.Namespace):
    """LoRA r=16 on all projections and the step's flags, the same on the loaded and on the abstract model."""
    jaxtune.get_peft_model(model, r=16, lora_alpha=16)
    model.remat_policy = REMAT_POLICIES[args.remat]
    model.single_sequence_rows = args.data == "dense"
    model.compute = args.compute
    model.unroll_layers = args.unroll_layers
    model.qat = None if args.qat == "none" else args.qat
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", default="1", help="a batch size, several (2,4,8: one load, each compiled in turn "
                    "until one runs out of memory) or auto")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--remat", default="none", choices=list(REMAT_POLICIES))
    ap.add_argument("--data", default="dense", choices=["dense", "dense-segmented", "varlen"],
                    help="dense: one sequence per row, attended plain causal as train() does for unpacked rows "
                         "(cuDNN); dense-segmented: the same rows through the segment-aware Pallas kernel; "
                         "varlen: packed variable-length samples")
    ap.add_argument("--compute", default="bf16", choices=["bf16", "fp8"], help="frozen projections in bf16 or FP8")
    ap.add_argument("--qat", default="none", choices=["none", "q4_0", "q4_k", "nf4"],
                    help="quantization-aware training: the merged weights seen as that 4-bit export stores them")
    ap.add_argument("--qat-impl", default="auto", choices=["auto", "kernel", "xla"],
                    help="--qat q4_0's weights by the one-pass Pallas kernel or XLA's passes (auto: the dispatch's "
                         "choice, the kernel on a GPU)")
    ap.add_argument("--moe-gemm", default="auto", choices=["auto", "wgmma", "triton"],
                    help="the frozen experts' grouped GEMMs by JAX's Mosaic GPU ragged dot (wgmma, Hopper) or the "
                         "Triton grouped kernel (auto: the dispatch's choice)")
    ap.add_argument("--moe-fp8-experts", action="store_true",
                    help="under --compute fp8, the frozen experts' GEMMs in e4m3 too (the grouped FP8 kernel)")
    ap.add_argument("--moe-mlp", default="fused", choices=["fused", "plain"],
                    help="the routed experts' MLP with its own VJP (fused) or autodiff of the plain composition")
    ap.add_argument("--unroll-layers", action="store_true",
                    help="one traced layer per decoder layer (no stacks of saved activations) instead of a loop")
    ap.add_argument("--offload-optimizer", action="store_true",
                    help="AdamW's state in host memory between steps (TrainConfig.offload_optimizer)")
    ap.add_argument("--offload-embedding", action="store_true",
                    help="the frozen input embedding in host memory (TrainConfig.offload_embedding)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--profile", help="write a jax.profiler trace of 2 steps to this folder (b<batch>/ in it)")
    ap.add_argument("--compile-first", action="store_true",
                    help="compile the step from the checkpoint's shapes before its weights reach the device, so "
                         "the GEMM autotuner's buffers and the weights are never resident together")
    ap.add_argument("--warm-autotune", action="store_true",
                    help="compile the step from the checkpoint's shapes before the weights load, drop it, and "
                         "compile again after loading: whether XLA's in-process autotuning results spare the "
                         "second compile its autotuner buffers")
    args = ap.parse_args()
    if (args.compile_first or args.warm_autotune) and not args.batch.isdigit():
        ap.error("--compile-first and --warm-autotune need a fixed --batch")
    if (args.compile_first or args.warm_autotune) and (args.offload_optimizer or args.offload_embedding):
        ap.error("--compile-first and --warm-autotune plan every array on the device: not with --offload-*")
    if args.qat_impl != "auto":
        dispatch.QAT_KERNEL_ON_GPU = args.qat_impl == "kernel"
    if args.moe_mlp == "plain":  # the A/B baseline: every grouped GEMM's input and output autodiff keeps
        from jaxtune.moe import block, expert_mlp
        block.expert_mlp = expert_mlp.expert_mlp_reference
    if args.moe_fp8_experts:
        dispatch.MOE_FP8_EXPERTS = True
    if args.moe_gemm != "auto":
        dispatch.MOE_WGMMA_ON_HOPPER = args.moe_gemm == "wgmma"
    cfg = jaxtune.TrainConfig(seq_len=args.seq, micro_batch_size=args.batch if args.batch == "auto" else int(args.batch.split(",")[0]),
                              max_steps=1000, learning_rate=1e-4, remat=args.remat, compute=args.compute,
                              offload_optimizer=args.offload_optimizer)
    optimizer = make_optimizer(cfg)

    def compile_step(graphdef, lora, opt_state, frozen, micro: int):
        step_fn = make_train_step(graphdef, cfg)
        shape = (1, micro, args.seq)
        batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k in ("input_ids", "labels", "segment_ids", "positions")}
        t0 = time.perf_counter()
        compiled = step_fn.compile(lora, opt_state, frozen, batch, jnp.int32(0))
        return compiled, time.perf_counter() - t0

    compiled, warm_s = None, None
    if args.compile_first or args.warm_autotune:
        from convert.load import abstract_model, load_hf_config

        graphdef, lora, frozen = split_model(configure(abstract_model(load_hf_config(args.model)), args))
        lora = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lora)
        compiled, compile_s = compile_step(graphdef, lora, jax.eval_shape(optimizer.init, lora), frozen, int(args.batch))
        if args.warm_autotune:
            compiled, warm_s = None, round(compile_s, 1)
    peak_after_compile = _peak_gib()

    t0 = time.perf_counter()
    if args.model.startswith("random:"):  # a shape of make_bnb4_checkpoint.py built on the device, no checkpoint
        import sys

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from benchmarks.tools.make_bnb4_checkpoint import random_model

        model = random_model(args.model.split(":", 1)[1])
    else:
        model, _ = jaxtune.from_pretrained(args.model, load_in_4bit=True)
    jax.block_until_ready(nnx.state(model))
    load_s = time.perf_counter() - t0
    peak_after_load = _peak_gib()
    graphdef, lora, frozen = split_model(configure(model, args))
    opt_state = optimizer.init(lora)
    if args.offload_optimizer:
        opt_state = place_on_host(opt_state)
    if args.offload_embedding:
        frozen = embedding_to_host(model, frozen)
    batches_arg = [args.batch] if args.batch == "auto" else [int(b) for b in args.batch.split(",")]
    for i, batch_arg in enumerate(batches_arg):  # a larger batch after an out-of-memory one would run out too
        if i:
            compiled = None
        try:
            lora, opt_state = run_batch(args, cfg, model, graphdef, lora, opt_state, frozen, batch_arg, compiled,
                                        compile_step, peak_after_load, peak_after_compile, load_s, warm_s)
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            print(json.dumps({"system": "jaxtune", "batch": batch_arg, "seq": args.seq, "remat": args.remat,
                              "error": "OOM", "message": str(e).splitlines()[0][:300]}), flush=True)
            break


def run_batch(args, cfg, model, graphdef, lora, opt_state, frozen, batch_arg, compiled, compile_step,
              peak_after_load, peak_after_compile, load_s, warm_s):
    """One batch size: compile (unless compiled first), the warm-up and timed steps, one JSON line, the trace."""
    t0 = time.perf_counter()
    if batch_arg == "auto":
        micro = choose_micro_batch(cfg, make_train_step(graphdef, cfg), lora, opt_state, frozen)
    else:
        micro = int(batch_arg)
    choose_s = time.perf_counter() - t0
    base = {"system": "jaxtune", "device": jax.local_devices()[0].device_kind, "batch": micro, "batch_arg": batch_arg,
            "seq": args.seq, "remat": args.remat, "data": args.data, "compute": args.compute,
            "unroll_layers": args.unroll_layers, "qat": args.qat, "qat_impl": args.qat_impl,
            "moe_gemm": args.moe_gemm,
            "moe_mlp": args.moe_mlp,
            "moe_fp8_experts": args.moe_fp8_experts,
            "offload_optimizer": args.offload_optimizer, "offload_embedding": args.offload_embedding,
            "compile_first": args.compile_first, "warm_autotune": args.warm_autotune, "warm_compile_s": warm_s}
    if compiled is None:
        compiled, compile_s = compile_step(graphdef, lora, opt_state, frozen, micro)
        peak_after_compile = _peak_gib()
    else:
        compile_s = 0.0
    base.update(compile_s=round(compile_s, 1), **memory_plan(compiled.compiled),
                peak_after_load_gib=peak_after_load, peak_after_compile_gib=peak_after_compile)
    if args.compile_only:
        print(json.dumps({**base, "device_limit_gib": round(
            (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 0) / 2**30, 2)}), flush=True)
        return lora, opt_state
    step_fn = compiled
    vocab = model.config.vocab_size
    count = args.warmup + args.steps
    if args.data == "varlen":
        batches, efficiency = packed_batches(micro, args.seq, vocab, count)
    else:
        batches, efficiency = dense_batches(micro, args.seq, vocab, count), 1.0
    batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in batches]
    t0 = time.perf_counter()
    lora, opt_state, m = step_fn(lora, opt_state, frozen, batches[0], jnp.int32(0))
    jax.block_until_ready(m)
    first_s = time.perf_counter() - t0
    for i in range(1, args.warmup):
        lora, opt_state, m = step_fn(lora, opt_state, frozen, batches[i], jnp.int32(i))
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(args.warmup, count):
        lora, opt_state, m = step_fn(lora, opt_state, frozen, batches[i], jnp.int32(i))
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / args.steps
    real = sum(int((b["segment_ids"] > 0).sum()) for b in batches[args.warmup:]) / args.steps
    slot_tok_s = micro * args.seq / dt
    print(json.dumps({
        **base, "step_s": round(dt, 4), "tok_s": round(real / dt), "slot_tok_s": round(slot_tok_s),
        "packing_efficiency": round(efficiency, 4),
        "mfu": round(real / dt * flops_per_token(model, args.seq) / PEAK_BF16_FLOPS, 3),
        "peak_gib": _peak_gib(), "load_s": round(load_s, 1),
        "first_step_s": round(first_s, 1), "auto_batch_s": round(choose_s, 1), "loss": float(m["loss"]),
    }), flush=True)

    if args.profile:
        jax.profiler.start_trace(os.path.join(args.profile, f"b{micro}"), create_perfetto_trace=True)
        for i in range(2):
            lora, opt_state, m = step_fn(lora, opt_state, frozen, batches[args.warmup + i], jnp.int32(count + i))
        jax.block_until_ready(m)
        jax.profiler.stop_trace()
    return lora, opt_state


if __name__ == "__main__":
    main()
