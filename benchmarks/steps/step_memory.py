"""What a compiled QLoRA step keeps in device memory at its peak, without a checkpoint (abstract weights).

On the GPU machine, from the repository root:
    PYTHONPATH=. python3 benchmarks/steps/step_memory.py --model llama3-70b --batch 1 --remat per-layer offload
    PYTHONPATH=. python3 benchmarks/steps/step_memory.py --model llama3-70b --remat offload --offload-optimizer --concats 10
Compiles the single-device training step (as `jaxtune.train` runs it) for each remat policy given, from the
shapes of a 4-bit model only (nothing is loaded or run), and prints one JSON line per policy: XLA's memory plan
(arguments, temporaries, host temporaries) and the largest buffers live at the planned peak (XLA's buffer
assignment), each with its shape and the operation that makes it. Where the peak goes is then named, not guessed.
`--concats N` adds the N largest concatenations of the optimized step (a join a GPU profile shows as a kernel of
its own, named by the JAX operation it came from); `--unroll-layers` and `--offload-optimizer` plan those variants.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

_BREAKDOWN = re.compile(r"[─└├│ ]*(.*?) \(([\d.]+)%, total: ([\d ]+) bytes, current: ([\d ]+) bytes")


def peak_buffers(dump_dir: str, top: int) -> list[dict]:
    """The largest values live at the step's planned peak, by the operation that makes them (the "Stack trace
    breakdown for peak usage" of XLA's live-range dump; on GPU, Pallas and cuBLAS outputs included)."""
    paths = sorted(glob.glob(os.path.join(dump_dir, "*step*live-range.txt")), key=os.path.getsize)
    if not paths:
        return []
    text = open(paths[-1]).read()
    start = text.find("Stack trace breakdown for peak usage")
    out = []
    for line in text[start:].splitlines()[1:] if start >= 0 else []:
        m = _BREAKDOWN.match(line)
        current = int(m[4].replace(" ", "")) if m else 0
        if current and m[1].strip() != "value":  # "value": a parameter (weights, LoRA, optimizer state)
            out.append({"gib": round(current / 2**30, 3), "op": m[1].strip()[-160:]})
    return sorted(out, key=lambda b: -b["gib"])[:top]


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_CONCAT = re.compile(r"%(\S+) = (\w+)\[([\d,]*)\]\S* concatenate\(.*?op_name=\"([^\"]*)\"")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?(\S+) .*\{\s*$")


def largest_concatenations(dump_dir: str, top: int) -> list[dict]:
    """The `top` largest concatenations of the optimized step (XLA's after-optimizations HLO): result MiB, shape,
    the computation holding each (a fusion's, e.g. a GPU `wrapped_concatenate`) and the JAX operation it came from,
    so a join the GPU profile shows as a kernel of its own can be named."""
    paths = sorted(glob.glob(os.path.join(dump_dir, "*step*after_optimizations.txt")), key=os.path.getsize)
    if not paths:
        return []
    out, computation = [], ""
    for line in open(paths[-1]):
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{")[0]:
            computation = header[1]
        m = _CONCAT.search(line)
        if m:
            count = 1
            for d in filter(None, m[3].split(",")):
                count *= int(d)
            out.append({"mib": round(count * _BYTES.get(m[2], 4) / 2**20, 2), "shape": f"{m[2]}[{m[3]}]",
                        "computation": computation, "instruction": m[1], "op": m[4][-160:]})
    return sorted(out, key=lambda c: -c["mib"])[:top]


def _parser() -> argparse.ArgumentParser:
    from benchmarks.tools.make_bnb4_checkpoint import MODELS

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-70b", choices=list(MODELS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--compute", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--remat", nargs="+", default=["per-layer"])
    ap.add_argument("--top", type=int, default=25, help="how many of the peak's buffers to print")
    ap.add_argument("--concats", type=int, default=0, help="also list this many of the largest concatenations")
    ap.add_argument("--unroll-layers", action="store_true", help="the step with one traced layer per decoder layer")
    ap.add_argument("--offload-optimizer", action="store_true", help="AdamW's state in host memory between steps")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # set for the child process that compiles one policy
    return ap


def main() -> None:
    args = _parser().parse_args()
    if args.one:
        compile_one(args, args.one)
        return
    for remat in args.remat:  # one process per policy: the dump folder and XLA's flags are per process
        dump = tempfile.mkdtemp(prefix="step_memory_")
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_module_re=.*step.*".strip()
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", remat], check=True,
                       env=dict(os.environ, XLA_FLAGS=flags))


def compile_one(args: argparse.Namespace, remat: str) -> None:
    import jax
    import jax.numpy as jnp

    import jaxtune
    from benchmarks.tools.make_bnb4_checkpoint import hf_config
    from benchmarks.steps.train_qlora import memory_plan
    from convert.load import abstract_model
    from jaxtune.models.config import ModelConfig
    from jaxtune.training.step import REMAT_POLICIES, make_optimizer, make_train_step, split_model

    cfg = ModelConfig.from_hf(hf_config(args.model))
    model = abstract_model(cfg)
    jaxtune.get_peft_model(model, r=args.rank, lora_alpha=args.rank)
    model.remat_policy = REMAT_POLICIES[remat]
    model.single_sequence_rows = True  # one sequence per row: how train() attends unpacked rows
    model.compute = args.compute
    model.offload_group, model.offload_device_layers = 1, 0
    model.unroll_layers = args.unroll_layers
    tcfg = jaxtune.TrainConfig(seq_len=args.seq, micro_batch_size=args.batch, max_steps=1000, learning_rate=1e-4,
                               remat=remat, compute=args.compute, offload_optimizer=args.offload_optimizer)
    graphdef, lora, frozen = split_model(model)
    optimizer = make_optimizer(tcfg)
    opt_state = jax.eval_shape(optimizer.init, lora)
    if args.offload_optimizer:  # planned where train() keeps it: the device's pinned host memory
        host = jax.sharding.SingleDeviceSharding(jax.local_devices()[0], memory_kind="pinned_host")
        opt_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), opt_state)
    lora = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), lora)
    step_fn = make_train_step(graphdef, tcfg)
    batch = {k: jax.ShapeDtypeStruct((1, args.batch, args.seq), jnp.int32)
             for k in ("input_ids", "labels", "segment_ids", "positions")}
    t0 = time.perf_counter()
    compiled = step_fn.lower(lora, opt_state, frozen, batch, jnp.int32(0)).compile()
    compile_s = time.perf_counter() - t0
    dump = re.search(r"--xla_dump_to=(\S+)", os.environ["XLA_FLAGS"])[1]
    print(json.dumps({
        "model": args.model, "batch": args.batch, "seq": args.seq, "rank": args.rank, "compute": args.compute,
        "remat": remat, "unroll_layers": args.unroll_layers, "offload_optimizer": args.offload_optimizer,
        "device": jax.local_devices()[0].device_kind, "compile_s": round(compile_s, 1), **memory_plan(compiled),
        "peak_buffers": peak_buffers(dump, args.top),
        **({"concatenations": largest_concatenations(dump, args.concats)} if args.concats else {})}), flush=True)


if __name__ == "__main__":
    main()
