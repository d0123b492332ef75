"""Run by tests/test_sharding.py in fresh processes (device count and jax.distributed are fixed at start-up).

    python tests/sharded_worker.py grads            # with XLA_FLAGS=--xla_force_host_platform_device_count=8
    python tests/sharded_worker.py train TOKENIZER_DIR OUT_DIR [MESH [OPTIONS_JSON]]  # optionally under jax.distributed
    python tests/sharded_worker.py grpo TOKENIZER_DIR OUT_DIR MESH[;MESH...]  # GRPO runs, one per mesh ("": none)
OPTIONS_JSON: {"steps": 5, "batch": 4 or "auto", "save_steps": 5, "resume": false, "moe": false (Qwen3-MoE),
               "sigterm_at": {"process": 1, "step": 2}, "raise_at": {"process": 1, "step": 2},
               "small_vocab_on": 1 (that process's model lacks the tokenizer's last 40 ids)}
Prints JSON lines.
"""

from __future__ import annotations

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxtune.parallel.distributed import initialize_from_env  # noqa: E402

initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxtune  # noqa: E402
import jaxtune.parallel.sharding as sharding  # noqa: E402
from jaxtune.models.config import ModelConfig  # noqa: E402
from jaxtune.models.causal_lm import init_model  # noqa: E402
from jaxtune.qlora import get_peft_model, quantize_layers  # noqa: E402
from jaxtune.training.step import loss_and_grads, split_model  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
sharding.MIN_SHARDED_ELEMENTS = 0  # shard even the tiny test arrays

CFG = ModelConfig(model_type="llama", vocab_size=320, hidden_size=128, intermediate_size=256, num_layers=2,
                  num_heads=2, num_kv_heads=1, head_dim=64, eos_token_id=2)


# a mixture of experts (Qwen3-MoE): 8 experts of width 64, top 2, NF4 expert stacks sharded like any weight
MOE_CFG = ModelConfig(**{**CFG.__dict__, "model_type": "qwen3_moe", "qk_norm": True, "num_experts": 8,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 64})


def model(vocab: int = 320, cfg: ModelConfig = CFG):
    cfg = cfg if vocab == cfg.vocab_size else ModelConfig(**{**cfg.__dict__, "vocab_size": vocab})
    m = get_peft_model(quantize_layers(init_model(cfg, dtype="float32", seed=0)), r=4, seed=1)
    lora = nnx.state(m, nnx.LoRAParam)  # non-zero B, so every LoRA gradient is non-trivial
    nnx.update(m, jax.tree.map(lambda p: p + 0.02 * jax.random.normal(jax.random.key(2), p.shape, p.dtype), lora))
    return m


def grads_on(mesh, graphdef, lora, frozen, batch):
    if mesh is None:
        fn = jax.jit(lambda l, f, b: loss_and_grads(graphdef, l, f, b, None, 64)[:2])
        return (*fn(lora, frozen, {k: jnp.asarray(v) for k, v in batch.items()}), [], [])
    lora, frozen = sharding.shard_state(mesh, lora), sharding.shard_state(mesh, frozen)
    spread = [str(a.sharding.spec) for a in jax.tree.leaves(frozen) if "fsdp" in str(a.sharding.spec)]
    assert mesh.shape["fsdp"] == 1 or spread, "no frozen array was sharded over fsdp"
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda l, f, b: loss_and_grads(graphdef, l, f, b, None, 64)[:2])
        gbatch = sharding.global_batch(mesh, batch)
        traced = fn.trace(lora, frozen, gbatch)  # traced once: lowered from the same trace
        kernels_per_shard = sorted(kernels_in_shard_maps(traced.jaxpr.jaxpr))
        compiled = traced.lower().compile()
        hlo = compiled.as_text()
        if mesh.shape["fsdp"] == 1:  # pure data parallel: nothing may be gathered (each device its own rows)
            assert "all-gather(" not in hlo, "a data-parallel step gathers activations across devices"
        moved = moved_activations(hlo, batch["input_ids"].shape[-1])
        return (*compiled(lora, frozen, gbatch), kernels_per_shard, moved)


def kernels_in_shard_maps(jaxpr, inside: bool = False) -> set[str]:
    """The Pallas kernels the step calls inside a shard_map (per shard), by name."""
    from test_kernel_dispatch import kernel_name, sub_jaxprs  # the suite's jaxpr walk (imported here: pytest's module)

    names = set()
    for e in jaxpr.eqns:
        if inside and kernel_name(e):
            names.add(kernel_name(e))
        for sub in sub_jaxprs(e):
            names |= kernels_in_shard_maps(sub, inside or e.primitive.name == "shard_map")
    return names


def moved_activations(hlo: str, seq_len: int) -> list[list[int]]:
    """Shapes of the arrays of `seq_len` tokens (activations) that a collective other than an all-reduce moves
    between devices in a compiled step (FSDP should move weights, not activations)."""
    shapes = re.findall(r"= \w+\[([\d,]*)\][^ ]* (?:all-gather|all-to-all|collective-permute)(?:-start)?\(", hlo)
    dims = [[int(d) for d in s.split(",") if d] for s in shapes]
    return [d for d in dims if seq_len in d]


def report(grads, ref_grads, **fields) -> None:
    """One JSON line: the fields and the largest gradient difference from the reference, with the scale."""
    # in numpy: on device each sharded leaf would compile its own programs for the arithmetic
    got, want = ([np.asarray(x, np.float64) for x in jax.tree.leaves(tree)] for tree in (grads, ref_grads))
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(got, want))
    scale = max(float(np.max(np.abs(b))) for b in want)
    print(json.dumps({**fields, "grad_max_abs_diff": diff, "grad_scale": scale}), flush=True)


def check_grads() -> None:
    assert jax.device_count() == 8, jax.devices()
    graphdef, lora, frozen = split_model(model())
    rng = np.random.default_rng(0)
    shape = (2, 8, 48)  # accum 2 x micro-batch 8 x T 48, packed segments and padding
    seg = np.ones(shape, np.int32)
    seg[..., 20:40], seg[..., 40:] = 2, 0
    labels = rng.integers(0, 320, shape).astype(np.int32)
    labels[seg == 0] = -1
    batch = {"input_ids": rng.integers(0, 320, shape).astype(np.int32), "labels": labels, "segment_ids": seg,
             "positions": jaxtune.models.causal_lm.segment_positions(jnp.asarray(seg.reshape(-1, 48))).reshape(shape)}
    batch["positions"] = np.asarray(batch["positions"])
    ref_loss, ref_grads, _, _ = grads_on(None, graphdef, lora, frozen, batch)
    # pure data parallel (nothing gathered) and FSDP within a 2-D mesh over all 8 devices; the Pallas kernels per
    # shard run below, in the FP8 and mixture-of-experts steps (the latter's attention and NF4 projections are the
    # dense model's kernels: a dense Pallas run compiled the same kernels per shard a third time)
    jaxtune.set_kernels("xla")
    for spec in ("data=8", "data=2,fsdp=4"):
        loss, grads, shard_maps, moved = grads_on(sharding.make_mesh(spec), graphdef, lora, frozen, batch)
        report(grads, ref_grads, mesh=spec, kernels="xla", loss=float(loss), ref_loss=float(ref_loss),
               shard_maps=shard_maps, moved_activations=moved)
    # FP8 on a mesh: the row quantizer and the FP8 GEMM (Pallas, interpreted) run per shard and reproduce the
    # single-device FP8 step of the XLA reference (the same e4m3 operands), whose loss is not the float32 one
    fp8 = model()
    fp8.compute = "fp8"
    graphdef, lora, frozen = split_model(fp8)
    fp8_loss, fp8_grads, _, _ = grads_on(None, graphdef, lora, frozen, batch)
    jaxtune.set_kernels("pallas-interpret")
    mesh = sharding.make_mesh("data=2,fsdp=2", jax.devices()[:4])
    loss, grads, shard_maps, moved = grads_on(mesh, graphdef, lora, frozen, batch)
    report(grads, fp8_grads, mesh="data=2,fsdp=2", kernels="pallas-interpret", compute="fp8", loss=float(loss),
           ref_loss=float(fp8_loss), float32_loss=float(ref_loss), shard_maps=shard_maps, moved_activations=moved)
    # a mixture of experts: its expert stacks sharded over fsdp too, the Pallas kernels (interpreted) as on a GPU
    jaxtune.set_kernels("xla")
    graphdef, lora, frozen = split_model(model(cfg=MOE_CFG))
    moe_loss, moe_grads, _, _ = grads_on(None, graphdef, lora, frozen, batch)
    jaxtune.set_kernels("pallas-interpret")
    mesh = sharding.make_mesh("data=2,fsdp=2", jax.devices()[:4])
    experts = [str(a.sharding.spec) for a in jax.tree.leaves(sharding.shard_state(mesh, frozen))
               if a.ndim == 4 and "fsdp" in str(a.sharding.spec)]  # [layers, experts, out, in / 2] codes
    loss, grads, shard_maps, moved = grads_on(mesh, graphdef, lora, frozen, batch)
    report(grads, moe_grads, mesh="data=2,fsdp=2", kernels="pallas-interpret", model="qwen3_moe", loss=float(loss),
           ref_loss=float(moe_loss), shard_maps=shard_maps, moved_activations=moved, sharded_experts=experts)


def train(tokenizer_dir: str, out_dir: str, mesh: str | None = None, options: str = "{}") -> None:
    import signal

    from convert.load import load_tokenizer
    from jaxtune.parallel.distributed import memory_stats, peak_memory_gib

    opts = json.loads(options)
    tok = load_tokenizer(tokenizer_dir)
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 4)} for i in range(48)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=64, micro_batch_size=opts.get("batch", 4),
                              max_steps=opts.get("steps", 5), learning_rate=3e-3, warmup_steps=0,
                              save_steps=opts.get("save_steps", 5), mesh=mesh or None)
    me = jax.process_index()

    def act(record):  # what a preempted host (SIGTERM) or a failing one (an exception) does at a given step
        if opts.get("sigterm_at", {}).get("process") == me and record["step"] == opts["sigterm_at"]["step"]:
            os.kill(os.getpid(), signal.SIGTERM)
        if opts.get("raise_at", {}).get("process") == me and record["step"] == opts["raise_at"]["step"]:
            raise RuntimeError(f"injected failure at step {record['step']}")

    # a host whose model lacks ids its tokenizer makes (a refusal while its data is tokenized, after the join)
    vocab = len(tok) - 40 if opts.get("small_vocab_on") == me else len(tok)
    trained = model(vocab, MOE_CFG if opts.get("moe") else CFG)
    result = jaxtune.train(trained, tok, rows, cfg, out_dir=out_dir, progress=False, callback=act,
                           resume=opts.get("resume", False))
    print(json.dumps({"process": me, "processes": jax.process_count(), "devices": jax.device_count(),
                      "losses": result.losses, "steps": result.steps, "interrupted": result.interrupted,
                      "micro_batch_size": result.micro_batch_size, "memory_stats": memory_stats(), "peak_gib": peak_memory_gib()}),
          flush=True)


def grpo(tokenizer_dir: str, out_dir: str, meshes: str) -> None:
    """GRPO with a KL term and two updates per rollout (the sampling policy's log-probabilities kept) on each mesh:
    its losses, rewards and sampled completions."""
    from convert.load import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    cfg = ModelConfig(model_type="llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=tok.eos_token_id)
    prompts = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    samples = []

    fails_on = os.environ.get("REWARD_FAILS_ON_PROCESS")  # a reward function failing on that host only

    def length_reward(prompts, completions, **_):
        if fails_on is not None and jax.process_index() == int(fails_on):
            raise ValueError("injected reward failure")
        samples.append(list(completions))
        return [float(len(c) % 3) for c in completions]

    for i, mesh in enumerate(meshes.split(";")):
        samples.clear()
        config = jaxtune.TrainConfig(objective="grpo", seq_len=40, max_completion_length=12, num_generations=4,
                                     micro_batch_size=8, max_steps=3, learning_rate=1e-2, warmup_steps=0,
                                     schedule="constant", lora_r=4, beta=0.04, num_iterations=2, mesh=mesh or None)
        result = jaxtune.train(quantize_layers(init_model(cfg, dtype="float32", seed=0)), tok, prompts, config,
                               out_dir=os.path.join(out_dir, str(i)), reward_funcs=[length_reward], progress=False)
        print(json.dumps({"mesh": mesh, "devices": jax.device_count(), "losses": result.losses,
                          "completions": samples}), flush=True)


if __name__ == "__main__":
    {"grads": check_grads, "train": train, "grpo": grpo}[sys.argv[1]](*sys.argv[2:])
