"""Training: chunked loss, accumulation, convergence, exact resume, NaN guard, CLI."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxtune
from jaxtune.models.config import ModelConfig
from jaxtune.data.packing import IGNORE
from jaxtune.models.causal_lm import init_model
from jaxtune.qlora import get_peft_model, quantize_layers
from jaxtune.training.loss import chunked_cross_entropy
from jaxtune.training.step import loss_and_grads, make_optimizer, split_model

ROWS = [{"messages": [{"role": "user", "content": f"hello {i}"},
                      {"role": "assistant", "content": f"world {i % 5} fox"}]} for i in range(48)]


def _model(tokenizer, seed=0):
    cfg = ModelConfig(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=tokenizer.eos_token_id)
    return quantize_layers(init_model(cfg, dtype="float32", seed=seed))


@pytest.mark.parametrize("chunk", [3, 5, 1024])
def test_chunked_cross_entropy_equals_dense(chunk):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((2, 7, 16)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((50, 16)), jnp.float32)
    labels = jnp.asarray(np.where(rng.random((2, 7)) < 0.3, IGNORE, rng.integers(0, 50, (2, 7))), jnp.int32)

    def dense(h, w):
        logits = jnp.einsum("bth,vh->btv", h, w)
        valid = labels != IGNORE
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
        return jnp.sum(jnp.where(valid, losses, 0.0))

    def chunked(h, w):
        return chunked_cross_entropy(h, w, labels, chunk_size=chunk)[0]

    np.testing.assert_allclose(chunked(hidden, head), dense(hidden, head), rtol=1e-5)
    for g_c, g_d in zip(jax.grad(chunked, (0, 1))(hidden, head), jax.grad(dense, (0, 1))(hidden, head)):
        np.testing.assert_allclose(g_c, g_d, rtol=1e-4, atol=1e-6)
    assert int(chunked_cross_entropy(hidden, head, labels, chunk_size=chunk)[1]) == int((labels != IGNORE).sum())


def test_accumulation_equals_one_big_batch(tiny_tokenizer):
    from jaxtune.training.loop import prepare_data

    model = get_peft_model(_model(tiny_tokenizer), r=4)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):  # non-zero B: all grads are non-trivial
        var.set_value(var.get_value() + 0.05)
    graphdef, lora, frozen = split_model(model)
    rows, _ = prepare_data(ROWS[:16], tiny_tokenizer, jaxtune.TrainConfig(seq_len=32, format="chat"))
    take = {k: getattr(rows, k)[:4] for k in ("input_ids", "labels", "segment_ids", "positions")}
    fn = jax.jit(lambda b: loss_and_grads(graphdef, lora, frozen, b, None, 64)[:2])
    loss_a, grads_a = fn({k: v.reshape(4, 1, -1) for k, v in take.items()})  # 4 micro-batches of 1
    loss_b, grads_b = fn({k: v.reshape(1, 4, -1) for k, v in take.items()})  # 1 batch of 4
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-8)


def test_loss_decreases(tiny_tokenizer):
    model = _model(tiny_tokenizer)
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=40, learning_rate=3e-3, schedule="constant",
                              lora_r=8)
    records = []
    result = jaxtune.train(model, tiny_tokenizer, ROWS, cfg, progress=False, callback=records.append)
    assert result.steps == 40 and result.skipped_steps == 0
    assert np.mean(result.losses[-5:]) < np.mean(result.losses[:5]) - 0.5  # nats
    assert 0.5 < result.packing_efficiency <= 1.0
    assert not any("collapsed" in r for r in records)  # a healthy run is never flagged


def test_unrolled_layers_train_as_the_layer_loop_does(tiny_tokenizer, tmp_path):
    """unroll_layers changes how the step is compiled, not what it computes: the same losses as the loop, and the
    run's config records it. Under remat, where the unrolled layers must keep the compiler from merging the
    recomputation into the forward pass; without remat the unrolled layers' gradients are the loop's in
    tests/test_layer_loop.py."""
    def run(unroll: bool):
        cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=4, learning_rate=3e-3, lora_r=8,
                                  lora_dropout=0.1, remat="selective", unroll_layers=unroll)
        out = tmp_path / f"unrolled-{unroll}"
        losses = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, out_dir=out, progress=False).losses
        return losses, json.loads((out / "config.json").read_text())["train"]["unroll_layers"]

    (looped, flag_off), (unrolled, flag_on) = run(False), run(True)
    assert (flag_off, flag_on) == (False, True)
    np.testing.assert_allclose(unrolled, looped, rtol=2e-5)
    assert looped[-1] < looped[0]


def test_a_collapsed_run_says_so(tiny_tokenizer):
    """An absurd learning rate: uniform predictions (loss = log vocab) and zero gradients, flagged and warned."""
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=6, learning_rate=1e9, schedule="constant",
                              lora_r=8)
    records = []
    with pytest.warns(UserWarning, match="training has collapsed: 3 steps in a row"):
        jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, progress=False, callback=records.append)
    flagged = [r["step"] for r in records if r.get("collapsed")]
    assert flagged and flagged == list(range(flagged[0], 7)) and flagged[0] >= 3


def test_a_small_dataset_trains_with_the_default_batch(tiny_tokenizer):
    """48 short chats at seq_len 1024 pack into fewer rows than the default micro-batch of 4: still trains."""
    cfg = jaxtune.TrainConfig(max_steps=2, lora_r=4)
    with pytest.warns(UserWarning, match="each step repeats rows from the next epoch"):
        result = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, progress=False)
    assert result.steps == 2 and result.micro_batch_size == 4 and all(np.isfinite(result.losses))


def test_resume_continues_exactly_with_the_optimizer_state_offloaded_or_not(tiny_tokenizer, tmp_path):
    """An interrupted run resumed from its checkpoint reaches the uninterrupted run's losses, step for step. The
    resumed run keeps AdamW's moments in host memory (offload_optimizer), which moves them, not what the step
    computes: the checkpoint and resume of host-resident state give the on-device run's losses too."""
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, grad_accum=2, max_steps=20, learning_rate=2e-3,
                              save_steps=5, lora_r=4, lora_dropout=0.1, eval_fraction=0.1, eval_steps=10)
    full = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, out_dir=tmp_path / "a", progress=False)

    def interrupt_at_10(record):
        if record["step"] == 10:
            os.kill(os.getpid(), signal.SIGINT)

    offloaded = jaxtune.TrainConfig(**{**cfg.to_dict(), "offload_optimizer": True})
    first = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, offloaded, out_dir=tmp_path / "b",
                          progress=False, callback=interrupt_at_10)
    assert first.interrupted and first.steps == 10
    with pytest.raises(jaxtune.JaxtuneError, match="resume"):
        jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, offloaded, out_dir=tmp_path / "b", progress=False)
    rest = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, offloaded, out_dir=tmp_path / "b", resume=True,
                         progress=False)
    assert rest.steps == 20
    np.testing.assert_allclose(rest.losses, full.losses, rtol=1e-6)
    metrics = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 21))
    assert (tmp_path / "b" / "loss.png").stat().st_size > 1000
    assert json.loads((tmp_path / "b" / "config.json").read_text())["train"]["offload_optimizer"] is True


def test_offloaded_optimizer_state_stays_in_host_memory_and_is_copied_in_after_the_gradients(tiny_tokenizer):
    from jaxtune.training.optimizer_offload import place_on_host
    from jaxtune.training.step import make_train_step

    cfg = jaxtune.TrainConfig(seq_len=32, micro_batch_size=1, max_steps=2, lora_r=4, offload_optimizer=True)
    graphdef, lora, frozen = split_model(get_peft_model(_model(tiny_tokenizer), r=4))
    optimizer = make_optimizer(cfg)
    opt_state = place_on_host(optimizer.init(lora))
    ids = np.arange(32, dtype=np.int32)[None, None] % 50
    batch = {"input_ids": ids, "labels": ids, "segment_ids": np.ones_like(ids), "positions": ids % 32}
    step = make_train_step(graphdef, cfg)
    jaxpr = jax.make_jaxpr(step.fn)(lora, opt_state, frozen, batch, np.int32(0), *step.trailing_args).jaxpr
    jaxpr = jaxpr.eqns[0].params["jaxpr"].jaxpr  # inside the step's jit
    n_lora, n_opt = len(jax.tree.leaves(lora)), len(jax.tree.leaves(opt_state))
    host_state = set(jaxpr.invars[n_lora:n_lora + n_opt])  # the step's optimizer-state arguments
    barrier = next(i for i, e in enumerate(jaxpr.eqns)
                   if e.primitive.name == "optimization_barrier" and host_state <= set(e.invars))
    # with the state, the barrier holds the gradients: float32 arrays of the LoRA parameters' shapes
    held = {(v.aval.shape, v.aval.dtype) for v in jaxpr.eqns[barrier].invars if v not in host_state}
    assert {(x.shape, jnp.dtype(jnp.float32)) for x in jax.tree.leaves(lora)} <= held
    copies_in = [e for e in jaxpr.eqns[barrier + 1:] if e.primitive.name == "device_put"
                 and "Device" in str(e.params.get("devices"))]
    assert copies_in and set(copies_in[0].invars) == {v for v in jaxpr.eqns[barrier].outvars[-n_opt:]}
    assert not any(e.primitive.name == "device_put" for e in jaxpr.eqns[:barrier])  # nothing copied in before
    lora, opt_state, m = step(lora, opt_state, frozen, batch, np.int32(0))
    assert np.isfinite(float(m["loss"]))
    assert {x.sharding.memory_kind for x in jax.tree.leaves(opt_state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(lora)} == {"device"}


def test_offloaded_embedding_trains_and_evaluates_as_on_device_and_comes_back_after(tiny_tokenizer):
    """offload_embedding moves the frozen table, not what the step computes: the same training and held-out losses
    as the table on the device; the table is in host memory while training runs and in device memory after."""
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=4, learning_rate=2e-3, lora_r=4,
                              eval_fraction=0.1, eval_steps=2)
    on_device = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, progress=False)
    model, kinds = _model(tiny_tokenizer), []
    table = np.asarray(model.embed_tokens.weight[...])
    offloaded = jaxtune.train(model, tiny_tokenizer, ROWS,
                              jaxtune.TrainConfig(**{**cfg.to_dict(), "offload_embedding": True}), progress=False,
                              callback=lambda r: kinds.append(model.embed_tokens.weight[...].sharding.memory_kind))
    np.testing.assert_allclose(offloaded.losses, on_device.losses, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in offloaded.eval_losses], [v for _, v in on_device.eval_losses],
                               rtol=1e-6)
    assert kinds == ["pinned_host"] * 4
    assert model.embed_tokens.weight[...].sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.weight[...]), table)


@pytest.mark.gpu
def test_on_a_gpu_host_offloads_train_the_same_and_leave_the_planned_device_bytes(tiny_tokenizer):
    """On a GPU (pinned host memory for real): the optimizer state and the input embedding in host memory train to
    the same losses, and the step's planned device bytes drop by at least what moved (so planning sees the gain)."""
    from jaxtune.training.autobatch import step_bytes
    from jaxtune.training.embedding_offload import embedding_to_host
    from jaxtune.training.optimizer_offload import place_on_host
    from jaxtune.training.step import make_train_step

    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=4, learning_rate=2e-3, lora_r=4)
    both = jaxtune.TrainConfig(**{**cfg.to_dict(), "offload_optimizer": True, "offload_embedding": True})
    on_device = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, progress=False).losses
    offloaded = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, both, progress=False).losses
    np.testing.assert_allclose(offloaded, on_device, rtol=1e-5)

    model = get_peft_model(_model(tiny_tokenizer), r=4)
    graphdef, lora, frozen = split_model(model)
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(lora)
    plain = step_bytes(make_train_step(graphdef, cfg), lora, opt_state, frozen, 2, cfg)
    moved = sum(x.nbytes for x in jax.tree.leaves(opt_state)) + model.embed_tokens.weight[...].nbytes
    opt_state, frozen = place_on_host(opt_state), embedding_to_host(model, frozen)
    planned = step_bytes(make_train_step(graphdef, both), lora, opt_state, frozen, 2, both)
    # most of it: the lookup's copy of the table and the update's copy of the state are temporaries of the step
    # (measured on an H100: 126,216 of 142,344 bytes off; XLA counts host arguments apart from device ones)
    assert planned <= plain - 0.75 * moved, (plain, planned, moved)


def test_embedding_in_host_memory_is_copied_in_for_the_lookup_only():
    from jaxtune.models.causal_lm import Embed

    embed = Embed(11, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
    table = np.asarray(embed.weight[...])
    embed.weight.set_value(jax.device_put(embed.weight[...], embed.weight[...].sharding.with_memory_kind("pinned_host")))
    ids = jnp.asarray([[3, 0, 10]], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda e, i: e(i))(embed, ids).jaxpr
    table_var = next(v for v in jaxpr.invars if v.aval.shape == (11, 4))
    assert jax.typeof(embed.weight[...]).memory_space == jax.memory.Space.Host
    uses = [e for e in jaxpr.eqns if table_var in e.invars]
    assert [e.primitive.name for e in uses] == ["device_put"] and "Device" in str(uses[0].params["devices"])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda e, i: e(i))(embed, ids)), table[[[3, 0, 10]]])


def test_a_refused_run_gives_the_offloaded_embedding_back_to_the_device(tiny_tokenizer, monkeypatch):
    from jaxtune.training import autobatch
    from jaxtune.training.autobatch import StepTooLarge

    monkeypatch.setattr(autobatch, "available_ram_bytes", lambda: 1024)  # refused after the table moved
    model = _model(tiny_tokenizer)
    with pytest.raises(StepTooLarge):
        jaxtune.train(model, tiny_tokenizer, ROWS, jaxtune.TrainConfig(seq_len=64, max_steps=1, micro_batch_size=2,
                                                                        offload_embedding=True), progress=False)
    assert model.embed_tokens.weight[...].sharding.memory_kind == "device"


def test_offload_embedding_refuses_a_tied_model_in_one_line(tiny_tokenizer):
    cfg = ModelConfig(model_type="llama", vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                      eos_token_id=tiny_tokenizer.eos_token_id)
    model = quantize_layers(init_model(cfg, dtype="float32"))
    with pytest.raises(jaxtune.JaxtuneError, match="ties it to the input embedding.*drop --offload-embedding"):
        jaxtune.train(model, tiny_tokenizer, ROWS, jaxtune.TrainConfig(seq_len=64, max_steps=1,
                                                                        offload_embedding=True), progress=False)


def test_nan_guard_stops_with_a_clear_message(tiny_tokenizer, tmp_path):
    model = _model(tiny_tokenizer)
    model.norm.weight.set_value(jnp.full_like(model.norm.weight[...], jnp.nan))
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=10, max_bad_steps=3)
    with pytest.raises(jaxtune.TrainingDiverged) as e:
        jaxtune.train(model, tiny_tokenizer, ROWS, cfg, out_dir=tmp_path / "run", progress=False)
    assert "3 steps in a row" in str(e.value) and "\n" not in str(e.value)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in metrics] == [1, 1, 1]
    lora_b = np.asarray(model.layers.mlp.up_proj.lora_b[...])
    assert not lora_b.any()  # parameters never took a non-finite update


def test_cli_train_smoke(tiny_tokenizer, tmp_path, capsys):
    from transformers import LlamaConfig

    from conftest import build_hf_model
    from jaxtune.cli import main

    build_hf_model(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    (tmp_path / "cfg.yaml").write_text("seq_len: 64\nlora_r: 4\nschedule: linear\n")
    code = main(["train", "--model", str(tmp_path / "m"), "--data", str(data), "--out", str(tmp_path / "run"),
                 "--max-steps", "3", "--batch-size", "2", "--dtype", "float32", "--config", str(tmp_path / "cfg.yaml")])
    assert code == 0
    assert "finished step 3" in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["train"]["seq_len"] == 64 and saved["train"]["schedule"] == "linear"
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
    code = main(["train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "nope.jsonl"), "--out",
                 str(tmp_path / "run2")])
    assert code == 1 and "does not exist" in capsys.readouterr().err
    for mesh, words in [("data=2", "does not divide the 1 devices"), ("data=2,fsdp=1", "needs 2 devices but there are 1"),
                        ("tp=2", "unknown axis 'tp'")]:
        code = main(["train", "--model", str(tmp_path / "m"), "--data", str(data), "--out", str(tmp_path / "run3"),
                     "--max-steps", "1", "--batch-size", "2", "--mesh", mesh])
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1].split("\r")[-1].strip()  # after any progress bars
        assert code == 1 and last.startswith("jaxtune: error: mesh") and words in last, err


def test_out_of_memory_steps_the_micro_batch_down(tiny_tokenizer, monkeypatch):
    import jaxtune.training.loop as loop

    real = loop.make_train_step
    seen_shapes = []

    def flaky(*args):
        step = real(*args)

        def run(lora, opt_state, frozen, batch, i):
            seen_shapes.append(batch["input_ids"].shape)
            if batch["input_ids"].shape[1] == 4:  # pretend micro-batch 4 does not fit
                raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while allocating")
            return step(lora, opt_state, frozen, batch, i)

        run.lower = step.lower  # memory planning compiles the real step
        return run

    monkeypatch.setattr(loop, "make_train_step", flaky)
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=4, max_steps=3)
    with pytest.warns(UserWarning, match="micro-batch lowered to 2"):
        result = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, progress=False)
    assert result.steps == 3 and seen_shapes[:2] == [(1, 4, 64), (2, 2, 64)] and seen_shapes[-1] == (2, 2, 64)


def test_out_of_memory_reported_only_when_results_are_read_is_refused_in_one_line(tiny_tokenizer, monkeypatch):
    """A launch that runs out of device memory may fail only when its results are read (asynchronous dispatch; seen
    at 70B, 32,768 tokens under a 48 GB cap), after the step consumed its donated arguments: the run ends in the
    one-line refusal, with what the step needs planned from the arguments' shapes, not in a raw runtime error."""
    import jaxtune.training.loop as loop
    from jaxtune.training.autobatch import StepTooLarge

    class FailsWhenRead:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 11.22GiB")

    real = loop.make_train_step

    def asynchronous_failure(*args):
        step = real(*args)

        def run(lora, opt_state, frozen, batch, i):
            lora, opt_state, m = step(lora, opt_state, frozen, batch, i)  # donates (deletes) the inputs
            return lora, opt_state, {k: FailsWhenRead() for k in m}

        run.lower = step.lower
        return run

    monkeypatch.setattr(loop, "make_train_step", asynchronous_failure)
    monkeypatch.setattr(loop, "memory_stats", lambda: {"bytes_limit": 2**30})
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=4, max_steps=2)
    with pytest.raises(StepTooLarge) as e:
        jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, cfg, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "the device has 1.0 GiB" in msg and "--seq-len (now 64)" in msg, msg
    assert re.search(r"needs \d+\.\d GiB", msg), msg  # planned although the donated arrays are gone
    assert msg.startswith("the training step ran out of memory"), msg  # its plan is under the 1 GiB it ran out of


def test_kill_9_during_checkpointing_leaves_a_loadable_checkpoint(tiny_tokenizer, tmp_path):
    import subprocess
    import sys
    import time

    from transformers import LlamaConfig

    from conftest import build_hf_model
    from jaxtune.training.checkpoint import RunCheckpoints

    build_hf_model(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxtune.cli", "train", "--model", str(tmp_path / "m"), "--data", str(data),
           "--out", str(run), "--max-steps", "100000", "--save-steps", "1", "--seq-len", "64", "--batch-size", "2",
           "--lora-r", "4", "--dtype", "float32"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        deadline = time.time() + 120
        def saved_steps():
            return [int(p.name) for p in (run / "checkpoints").glob("[0-9]*") if p.name.isdigit()]

        while time.time() < deadline and max(saved_steps(), default=0) < 3:
            time.sleep(0.05)
        time.sleep(0.37)  # land somewhere inside the next saves
    finally:
        proc.kill()  # SIGKILL: no handler runs
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpts = RunCheckpoints(str(run))
    latest = ckpts.latest_step()
    assert latest is not None and latest >= 3
    model = get_peft_model(_model(tiny_tokenizer), r=4)
    graphdef, lora, frozen = split_model(model)
    opt_state = make_optimizer(jaxtune.TrainConfig(lora_r=4)).init(lora)
    restored, _, meta = ckpts.restore(lora, opt_state)
    assert meta["step"] == latest and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored))
    ckpts.close()


def _auto_batch_step(tokenizer):
    """(config, step function, LoRA state, optimizer state, frozen state) of the tiny model, batch size auto."""
    from jaxtune.training.step import make_train_step

    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size="auto")
    graphdef, lora, frozen = split_model(get_peft_model(_model(tokenizer), r=4))
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(lora)
    return cfg, make_train_step(graphdef, cfg), lora, opt_state, frozen


def test_auto_batch_picks_the_largest_micro_batch_that_fits(tiny_tokenizer):
    from jaxtune.training.autobatch import MARGIN, choose_micro_batch, step_bytes

    cfg, step_fn, lora, opt_state, frozen = _auto_batch_step(tiny_tokenizer)
    need = {m: step_bytes(step_fn, lora, opt_state, frozen, m, cfg) for m in (1, 2, 4, 8)}
    assert need[1] < need[2] < need[4] < need[8]  # compiled memory grows with the micro-batch
    for fits in (1, 2, 4, 8):
        limit = int((need[fits] + 1) / MARGIN) + 1
        assert choose_micro_batch(cfg, step_fn, lora, opt_state, frozen, bytes_limit=limit) == fits
    # never more rows than the dataset packs into, whatever memory allows
    roomy = int((need[8] + 1) / MARGIN) + 1  # fits 8
    for rows, most in ((61, 8), (7, 4), (2, 2), (1, 1)):
        assert choose_micro_batch(cfg, step_fn, lora, opt_state, frozen, bytes_limit=roomy, rows=rows) == most


def test_fused_cross_entropy_gradient_in_bfloat16_matches_float64():
    """bf16 operands, f32 accumulation: loss and d loss / d hidden within bf16 rounding of a float64 reference."""
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((3, 37, 64)).astype(np.float32)
    head = (0.3 * rng.standard_normal((300, 64))).astype(np.float32)
    labels = np.where(rng.random((3, 37)) < 0.2, IGNORE, rng.integers(0, 300, (3, 37))).astype(np.int32)
    h16, w16 = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(head, jnp.bfloat16)
    loss, grad = jax.value_and_grad(lambda h: chunked_cross_entropy(h, w16, jnp.asarray(labels), chunk_size=16)[0])(h16)

    h64, w64 = np.asarray(h16, np.float64), np.asarray(w16, np.float64)
    logits = h64 @ w64.T
    logits -= logits.max(-1, keepdims=True)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    valid = labels != IGNORE
    target = np.where(valid, labels, 0)
    want_loss = -np.log(np.take_along_axis(probs, target[..., None], -1)[..., 0])[valid].sum()
    dlogits = (probs - np.eye(300)[target]) * valid[..., None]
    want_grad = dlogits @ w64
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-4)
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(grad, np.float64), want_grad, rtol=2e-2, atol=2e-2 * np.abs(want_grad).max())


def test_auto_batch_compiles_the_chosen_size_and_little_else(tiny_tokenizer, monkeypatch):
    """The size chosen is one the search compiled (the loop's jit reuses that compilation), and the search
    compiles at most two other sizes (micro 1, and one measured point when the first bound is loose)."""
    import jaxtune.training.autobatch as autobatch

    cfg, step_fn, lora, opt_state, frozen = _auto_batch_step(tiny_tokenizer)
    need = {m: autobatch.step_bytes(step_fn, lora, opt_state, frozen, m, cfg) for m in (1, 16)}
    compiled, real = [], autobatch._step_memory

    def counting(step_fn, lora, opt_state, frozen, micro, cfg):
        compiled.append(micro)
        return real(step_fn, lora, opt_state, frozen, micro, cfg)

    monkeypatch.setattr(autobatch, "_step_memory", counting)
    for limit in (need[1] * 1.5, need[1] * 3, need[16] * 0.8, need[16] * 1.2):
        compiled.clear()
        micro = autobatch.choose_micro_batch(cfg, step_fn, lora, opt_state, frozen, bytes_limit=int(limit / autobatch.MARGIN))
        assert micro in compiled and compiled[0] == 1 and len(compiled) <= 3, (limit, micro, compiled)
        assert real(step_fn, lora, opt_state, frozen, micro, cfg)[0] <= limit  # and it fits


@pytest.mark.parametrize("packing, single", [(False, True), (True, False)])
def test_unpacked_rows_train_with_plain_causal_attention(tiny_tokenizer, monkeypatch, packing, single):
    """Without packing every row holds one chat: the step's model attends plain causal (cuDNN on GPU); the
    user's model keeps honouring segment ids afterwards."""
    import jaxtune.training.loop as loop

    seen = []
    real_split = loop.split_model
    monkeypatch.setattr(loop, "split_model", lambda m: seen.append(m.single_sequence_rows) or real_split(m))
    model = _model(tiny_tokenizer)
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=2, lora_r=4, packing=packing)
    result = jaxtune.train(model, tiny_tokenizer, ROWS, cfg, progress=False)
    assert seen == [single] and not model.single_sequence_rows and all(np.isfinite(result.losses))


def test_pinned_host_cap_is_what_this_host_can_give_in_full_unless_the_user_set_it(monkeypatch):
    """XLA's pinned pool pins its whole cap for a large offload, so the cap jaxtune sets is available memory minus a
    reserve for the process and the system, never below XLA's 64 GiB default, and a user's own value stays."""
    import os
    import subprocess
    import sys

    from jaxtune.platform import host_info

    gib = 2**30
    for available, total, cap in [(121 * gib, 125 * gib, 105),  # the H100 host: 16 GiB kept back
                                  (1900 * gib, 2000 * gib, 1700),  # large hosts keep 10%
                                  (40 * gib, 48 * gib, 64)]:  # small hosts keep XLA's default
        monkeypatch.delenv(host_info.PINNED_CAP_ENV, raising=False)
        monkeypatch.setattr(host_info, "available_ram_bytes", lambda: available)
        monkeypatch.setattr(host_info, "physical_ram_bytes", lambda: total)
        host_info.set_pinned_host_cap()
        assert os.environ[host_info.PINNED_CAP_ENV] == str(cap) and host_info.pinned_cap_bytes() == cap * gib
    monkeypatch.setenv(host_info.PINNED_CAP_ENV, "7")
    host_info.set_pinned_host_cap()
    assert host_info.pinned_cap_bytes() == 7 * gib
    # importing jaxtune sets it, before any JAX backend starts
    code = "import os, jaxtune; print(os.environ['XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'])"
    env = {k: v for k, v in os.environ.items() if k != host_info.PINNED_CAP_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert 64 <= int(out) <= max(64, host_info.physical_ram_bytes() // gib - 16)


def test_xla_may_use_most_of_the_gpu_unless_the_user_said_how_it_allocates(monkeypatch):
    """XLA's own default preallocates 75% of the GPU (59 of an 80 GB card's 79 GiB: too little for a 70B step at
    134k tokens, which needs 69); importing jaxtune raises the share unless the user set any allocator variable,
    and XLA's client reads the value as its memory fraction."""
    import os
    import subprocess
    import sys

    from jaxtune.platform import device_memory_env

    for name in device_memory_env.USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    device_memory_env.set_device_memory_fraction()
    assert float(os.environ["XLA_CLIENT_MEM_FRACTION"]) == device_memory_env.DEVICE_MEMORY_FRACTION > 0.75
    for name, value in [("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
                        ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform"), ("XLA_CLIENT_MEM_FRACTION", ".6")]:
        for other in device_memory_env.USER_SETTINGS:
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(name, value)
        device_memory_env.set_device_memory_fraction()
        assert {n: os.environ.get(n) for n in device_memory_env.USER_SETTINGS if n in os.environ} == {name: value}
    code = ("import jaxtune; from jaxlib import xla_client; "
            "print(xla_client.generate_pjrt_gpu_plugin_options()['memory_fraction'])")
    env = {k: v for k, v in os.environ.items() if k not in device_memory_env.USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert float(out) == device_memory_env.DEVICE_MEMORY_FRACTION


def test_host_budget_counts_the_pinned_region_an_offload_plan_makes():
    """The pool grows by power-of-two regions clipped to the cap: a 100 GiB plan under a 112 GiB cap pins 112 GiB,
    which is what ran a 125 GiB host out of memory; under a 1024 GiB cap it would pin 128."""
    from jaxtune.training.host_memory import HostBudget

    gib = 2**30
    assert HostBudget(available=0, cap=112 * gib, margin=0).pinned(100 * gib) == 112 * gib
    assert HostBudget(available=0, cap=1024 * gib, margin=0).pinned(100 * gib) == 128 * gib
    assert HostBudget(available=0, cap=1024 * gib, margin=0).pinned(24 * gib) == 32 * gib
    assert HostBudget(available=0, cap=1024 * gib, margin=0).pinned(1) == 2 * 2**20
    host = HostBudget(available=116 * gib, cap=112 * gib, margin=6 * gib)  # at train(): the process holds 5 GiB
    assert not host.fits(100 * gib) and not host.fits(65 * gib) and host.fits(64 * gib)
    host = HostBudget(available=116 * gib, cap=105 * gib, margin=6 * gib)  # the cap jaxtune sets there
    assert not host.fits(100 * gib) and host.fits(94 * gib)  # 90% of the cap: room for staging regions
    assert 0 < HostBudget.now().available


def test_host_budget_is_the_tightest_of_every_process(monkeypatch):
    """Processes plan the offload layout from the same figures (else they would compile different steps): the
    least available memory, the lowest cap and the largest margin any of them has."""
    import jaxtune.parallel.distributed
    from jaxtune.training.host_memory import HostBudget

    mib = 2**20
    monkeypatch.setattr(jaxtune.parallel.distributed, "agree_min", lambda v: v - 7)  # another process: 7 MiB tighter each
    budget = HostBudget.now()
    monkeypatch.setattr(jaxtune.parallel.distributed, "agree_min", lambda v: v)
    alone = HostBudget.now()
    assert abs(budget.available - (alone.available - 7 * mib)) < 256 * mib  # MemAvailable moves between reads
    assert budget.cap == alone.cap - 7 * mib and budget.margin == alone.margin + 7 * mib


def test_offload_group_is_the_smallest_that_host_memory_holds():
    from jaxtune.errors import JaxtuneError
    from jaxtune.training.host_memory import HostBudget, offload_group

    gib = 2**30
    host = HostBudget(available=100 * gib, cap=1024 * gib, margin=0)
    assert offload_group(32, 2 * gib, host) == 1  # 64 GiB of inputs: a 64 GiB region
    assert offload_group(32, 4 * gib, host) == 2  # 128 GiB do not fit: every other input, 64 GiB
    assert offload_group(32, 3 * gib, host) == 2  # 96 GiB would pin 128: every other input, 48 GiB pins 64
    assert offload_group(30, 4 * gib, HostBudget(available=40 * gib, cap=1024 * gib, margin=0)) == 5  # divisors
    with pytest.raises(JaxtuneError, match="shorten seq_len"):
        offload_group(32, 50 * gib, HostBudget(available=40 * gib, cap=1024 * gib, margin=0))


def test_offload_layouts_keep_what_host_memory_cannot_hold_on_device_then_group():
    from jaxtune.training.host_memory import HostBudget, offload_layouts

    gib = 2**30
    layer = 100 * gib // 32  # 409,600 tokens of Llama-3-8B: 100 GiB of layer inputs
    h100 = HostBudget(available=116 * gib, cap=105 * gib, margin=6 * gib)
    assert offload_layouts(32, layer // 2, h100) == [(0, 1)]
    assert offload_layouts(32, layer, h100) == [(2, 1), (0, 2)]  # 30 inputs, 93.75 GiB, pin the 105 GiB cap
    # a cap above what the host can give: only plans whose power-of-two region fits (64 GiB: 20 inputs)
    assert offload_layouts(32, layer, HostBudget(available=116 * gib, cap=112 * gib, margin=6 * gib)) == [(12, 1), (0, 2)]
    assert offload_layouts(32, 50 * gib, HostBudget(available=80 * gib, cap=1024 * gib, margin=0)) == [(31, 1), (0, 32)]


def test_host_memory_guard_stops_offloading_runs_before_host_memory_runs_out():
    import subprocess
    import sys
    import threading

    from jaxtune.training.host_memory import HOST_EXHAUSTED_EXIT, HostMemoryGuard

    gib = 2**30
    seen = []
    readings = iter([10 * gib, 3 * gib, None, gib // 2])
    guard = HostMemoryGuard(2 * gib, available=lambda: next(readings), on_exhausted=seen.append)
    assert [guard.check() for _ in range(4)] == [True, True, True, False] and seen == [gib // 2]
    assert guard.lowest == gib // 2  # the least it saw (benchmarks report it)
    hit = threading.Event()
    with HostMemoryGuard(2 * gib, available=lambda: gib, on_exhausted=lambda a: hit.set(), interval_s=0.01):
        assert hit.wait(5)  # the watching thread fires on its own
    # the default action, against this machine's real /proc/meminfo: a one-line reason and a distinct exit status
    code = ("from jaxtune.training.host_memory import HostMemoryGuard; HostMemoryGuard(2**62).check(); "
            "print('not stopped')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == HOST_EXHAUSTED_EXIT and "not stopped" not in proc.stdout
    assert "host memory nearly exhausted" in proc.stderr and "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in proc.stderr


def _host_holds_one_layer_input(monkeypatch):
    """The tiny model's layer inputs are 32 KiB each: a 40 KiB pinned cap holds one of its two."""
    from jaxtune.training.host_memory import HostBudget

    monkeypatch.setattr(HostBudget, "now", classmethod(lambda cls: HostBudget(2**30, 40 * 1024, 0)))


@pytest.mark.parametrize("device_fits, layout", [(True, (1, 1)), (False, (0, 2))])
def test_offloading_training_keeps_inputs_on_device_or_groups_layers_when_host_memory_is_short(
        tiny_tokenizer, monkeypatch, capsys, device_fits, layout):
    import jaxtune.training.loop as loop

    seen = []
    real_split = loop.split_model
    monkeypatch.setattr(loop, "split_model",
                        lambda m: seen.append((m.offload_device_layers, m.offload_group)) or real_split(m))
    monkeypatch.setattr(loop, "offloads_to_host", lambda: True)  # the GPU-only planning, on CPU
    _host_holds_one_layer_input(monkeypatch)
    limit = 2**40 if device_fits else 2**20  # the compiled step needs a few MiB
    monkeypatch.setattr(loop, "memory_stats", lambda: {"bytes_limit": limit})
    model = _model(tiny_tokenizer)
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=2, lora_r=4, remat="offload")
    result = jaxtune.train(model, tiny_tokenizer, ROWS, cfg, progress=False)
    assert seen[-1] == layout and seen == [(1, 1)] + ([] if device_fits else [(0, 2)])
    assert (model.offload_group, model.offload_device_layers) == (1, 0) and all(np.isfinite(result.losses))
    out = capsys.readouterr().out
    assert ("inputs of 1 of 2 layers stay in device memory" if device_fits
            else "host memory holds the input of one layer in 2") in out




def test_remat_auto_as_last_resort_also_keeps_optimizer_state_and_embedding_in_host_memory(
        tiny_tokenizer, monkeypatch, tmp_path, capsys):
    """When no policy fits (a small card), remat auto's last resort "offload" also moves AdamW's state and the input
    embedding to host memory, says so in one line, records it, and trains as those options set explicitly."""
    import jaxtune.training.loop as loop
    import jaxtune.training.remat_choice as remat_choice

    monkeypatch.setattr(loop, "offloads_to_host", lambda: True)  # the GPU-only planning, on CPU
    monkeypatch.setattr(remat_choice, "memory_stats", lambda: {"bytes_limit": 1})  # nothing fits
    base = dict(seq_len=64, micro_batch_size=2, max_steps=3, lora_r=4, learning_rate=2e-3)
    auto = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, jaxtune.TrainConfig(**base),
                         out_dir=tmp_path / "auto", progress=False)
    said = [line for line in capsys.readouterr().out.splitlines() if "remat auto" in line]
    assert "none fits, offload is the last resort" in said[0], said
    assert said[1] == ("remat auto: the optimizer state (offload_optimizer) and the input embedding "
                       "(offload_embedding) also kept in host memory")
    recorded = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert (recorded["remat"], recorded["offload_optimizer"], recorded["offload_embedding"]) == ("offload", True, True)
    assert recorded["train"]["remat"] == "auto" and auto.remat == "offload"
    assert auto.offload_optimizer and auto.offload_embedding
    explicit = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS,
                             jaxtune.TrainConfig(**base, remat="offload", offload_optimizer=True,
                                                 offload_embedding=True), progress=False)
    assert auto.losses == explicit.losses


@pytest.mark.gpu
@pytest.mark.parametrize("bytes_limit, layout", [(None, (1, 1)), (2**20, (0, 2))])
def test_offloading_on_a_gpu_runs_the_layout_host_and_device_memory_allow(tiny_tokenizer, monkeypatch, bytes_limit,
                                                                         layout):
    """On a GPU (pinned-host offload for real): with host memory short, the device keeps the inputs the host
    cannot hold when the compiled step fits; with too little device memory it groups layers instead."""
    import jaxtune.training.loop as loop

    seen = []
    real_split = loop.split_model
    monkeypatch.setattr(loop, "split_model",
                        lambda m: seen.append((m.offload_device_layers, m.offload_group)) or real_split(m))
    _host_holds_one_layer_input(monkeypatch)
    if bytes_limit is not None:
        monkeypatch.setattr(loop, "memory_stats", lambda: {"bytes_limit": bytes_limit})
    model = _model(tiny_tokenizer)
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=3, lora_r=4, remat="offload")
    result = jaxtune.train(model, tiny_tokenizer, ROWS, cfg, progress=False)
    assert seen[-1] == layout and result.steps == 3 and all(np.isfinite(result.losses))


def test_remat_auto_picks_the_fastest_policy_that_fits_and_trains_as_that_policy(tiny_tokenizer, monkeypatch,
                                                                                 tmp_path, capsys):
    """remat="auto" (the default) compiles the candidates fastest first and takes the first whose step fits: with
    room, "selective"; with a device between the two policies' needs, "per-layer"; with room for neither, the last
    candidate (on CPU "per-layer": offloading to the host saves nothing there). It says what it picked and why in
    one line, records it in the run's config, and trains exactly as the chosen policy run explicitly."""
    import jaxtune.training.remat_choice as remat_choice
    from jaxtune.training.autobatch import MARGIN

    assert jaxtune.TrainConfig().remat == "auto"
    needs = []
    real = remat_choice.step_bytes_or_none
    monkeypatch.setattr(remat_choice, "step_bytes_or_none", lambda *a: needs.append(real(*a)) or needs[-1])
    base = dict(seq_len=128, micro_batch_size=2, max_steps=3)

    def run(name, **kw):
        result = jaxtune.train(_model(tiny_tokenizer), tiny_tokenizer, ROWS, jaxtune.TrainConfig(**base, **kw),
                               out_dir=tmp_path / name, progress=False)
        chosen = json.loads((tmp_path / name / "config.json").read_text())["remat"]
        assert result.remat == chosen
        return result.losses, chosen, [line for line in capsys.readouterr().out.splitlines() if "remat auto" in line]

    losses, chosen, said = run("roomy")
    assert chosen == "selective" and len(needs) == 1 and len(said) == 1 and "selective needs" in said[0], said
    assert losses == run("selective", remat="selective")[0]

    needs.clear()
    with monkeypatch.context() as m:  # find both needs: a device too small for either
        m.setattr(remat_choice, "memory_stats", lambda: {"bytes_limit": 1})
        _, chosen, said = run("tiny")
    selective, per_layer = needs
    assert per_layer < selective and chosen == "per-layer", said
    assert "none fits, per-layer is the last resort" in said[0], said

    needs.clear()
    monkeypatch.setattr(remat_choice, "memory_stats",
                        lambda: {"bytes_limit": (selective + per_layer) / 2 / MARGIN})
    losses, chosen, said = run("between")
    assert chosen == "per-layer" and len(needs) == 2 and "per-layer fits" in said[0], said
    assert "\n" not in said[0] and f"{selective / 2**30:,.1f} GiB" in said[0]
    assert losses == run("per-layer", remat="per-layer")[0]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_learning_rate_schedule_is_optaxs(schedule):
    """The schedule the step computes from its hyperparameter arguments, against optax's own warmup schedules."""
    from jaxtune.training.step import make_schedule

    for warm, total in ((0, 1), (0, 7), (3, 10), (5, 5), (10, 1000)):
        peak = 3e-4
        if schedule == "cosine":
            want = optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(total, warm + 1), end_value=0.0)
        else:
            after = (optax.constant_schedule(peak) if schedule == "constant"
                     else optax.linear_schedule(peak, 0.0, max(total - warm, 1)))
            want = optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm]) if warm else after
        with pytest.warns(UserWarning) if warm >= total else contextlib.nullcontext():
            cfg = jaxtune.TrainConfig(schedule=schedule, warmup_steps=warm, max_steps=total, learning_rate=peak)
        got = make_schedule(cfg)
        for step in range(total + 3):
            assert float(got(np.int32(step))) == pytest.approx(float(want(step)), rel=0, abs=1e-6 * peak), (warm, step)


def test_runs_differing_only_in_optimizer_numbers_compile_one_step(tiny_tokenizer):
    """The learning rate, warmup, step count, weight decay, betas and clipping norm are arguments of the compiled
    step: a sweep over them lowers to one program (served by the compilation cache), the schedule's kind does not."""
    from jaxtune.training.step import make_train_step

    graphdef, lora, frozen = split_model(get_peft_model(_model(tiny_tokenizer), r=4))
    batch = {k: jnp.zeros((1, 2, 32), jnp.int32) for k in ("input_ids", "labels", "segment_ids", "positions")}

    def program(**settings):
        cfg = jaxtune.TrainConfig(seq_len=32, micro_batch_size=2, **settings)
        opt_state = make_optimizer(cfg).init(lora)
        return make_train_step(graphdef, cfg).lower(lora, opt_state, frozen, batch, np.int32(0)).as_text()

    base = program()
    assert program(learning_rate=1e-3, warmup_steps=3, max_steps=7, weight_decay=0.1, adam_b1=0.8, adam_b2=0.99,
                   max_grad_norm=0.5) == base
    assert program(schedule="linear") != base


def test_a_held_out_split_of_any_size_is_evaluated_by_one_compiled_program(tiny_tokenizer):
    """5 held-out rows in batches of 2: the last batch is padded with rows that carry no loss, so the evaluation
    compiles once, and the token-weighted mean is that of the 5 rows evaluated together in one batch."""
    from jaxtune.data import PackedRows
    from jaxtune.training.evaluation import held_out_means
    from jaxtune.training.step import make_eval_step

    rng = np.random.default_rng(0)
    ids = rng.integers(3, 200, (5, 32)).astype(np.int32)
    segments = np.ones_like(ids)
    segments[:, 20:] = 0  # padding at the end of every row
    labels = np.where(segments > 0, np.roll(ids, -1, axis=1), IGNORE).astype(np.int32)
    positions = np.tile(np.arange(32, dtype=np.int32), (5, 1))
    rows = PackedRows(ids, labels, segments, positions, truncated=0)
    cfg = jaxtune.TrainConfig(seq_len=32, micro_batch_size=2, lora_r=4)
    graphdef, lora, frozen = split_model(get_peft_model(_model(tiny_tokenizer), r=4, seed=1))
    eval_fn = make_eval_step(graphdef, cfg)
    loss, _ = held_out_means(eval_fn, lora, frozen, rows, micro=2)
    assert eval_fn.fn._cache_size() == 1  # batches of 2, 2 and 1 + 1 padding row: one program
    together, _ = held_out_means(make_eval_step(graphdef, cfg), lora, frozen, rows, micro=5)
    assert np.isfinite(loss) and loss == pytest.approx(together, rel=1e-6)


@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (3.0, 1.0), (None, 0.7), (3.0, 0.7)])
def test_soft_capped_chunked_losses_equal_float64_autodiff(softcap, temperature):
    """Gemma's final-logit soft cap inside the chunked losses: the loss, per-token log-probabilities and both
    gradients equal numpy float64 of cap * tanh(logits / cap), differentiated by hand; the per-token
    log-probabilities and their gradients also at a sampling temperature, applied after the cap (as a sampler,
    and TRL's GRPO, divide the model's capped logits)."""
    from jaxtune.training.loss import chunked_token_logps

    rng = np.random.default_rng(7)
    h = rng.standard_normal((2, 9, 8)).astype(np.float32)
    w = (2.0 * rng.standard_normal((13, 8))).astype(np.float32)  # large logits: the cap bites
    labels = rng.integers(0, 13, (2, 9))
    labels[0, :3] = IGNORE
    logits = np.einsum("bth,vh->btv", h.astype(np.float64), w.astype(np.float64))
    capped = (logits if softcap is None else softcap * np.tanh(logits / softcap)) / temperature
    logp = capped - np.log(np.exp(capped).sum(-1, keepdims=True))
    valid = labels != IGNORE
    picked = np.take_along_axis(logp, np.where(valid, labels, 0)[..., None], -1)[..., 0] * valid
    dcapped = (np.exp(logp) - np.eye(13)[np.where(valid, labels, 0)]) * valid[..., None] / temperature
    dlogits = dcapped if softcap is None else dcapped * (1 - np.tanh(logits / softcap) ** 2)
    if temperature == 1.0:
        loss, (dh, dw) = jax.value_and_grad(lambda a, b: chunked_cross_entropy(
            a, b, jnp.asarray(labels), chunk_size=4, softcap=softcap)[0], argnums=(0, 1))(h, w)
        np.testing.assert_allclose(float(loss), -picked.sum(), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(dh), np.einsum("btv,vh->bth", dlogits, w), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(dw), np.einsum("btv,bth->vh", dlogits, h), rtol=1e-4, atol=1e-5)
    token_fn = lambda a, b: chunked_token_logps(a, b, jnp.asarray(labels), chunk_size=4, softcap=softcap,  # noqa: E731
                                                temperature=temperature)
    np.testing.assert_allclose(np.asarray(token_fn(jnp.asarray(h), jnp.asarray(w))), picked, rtol=1e-5, atol=1e-6)
    # d(sum of token weights * logp) with random token weights: each token's cotangent scales its own gradient
    g = rng.standard_normal(labels.shape)
    dh, dw = jax.grad(lambda a, b: jnp.sum(token_fn(a, b) * g), argnums=(0, 1))(h, w)
    dweighted = -dlogits * g[..., None]
    np.testing.assert_allclose(np.asarray(dh), np.einsum("btv,vh->bth", dweighted, w), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), np.einsum("btv,bth->vh", dweighted, h), rtol=1e-4, atol=1e-5)
