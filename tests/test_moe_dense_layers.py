"""Qwen3-MoE with dense MLP layers among the sparse ones (`mlp_only_layers`, `decoder_sparse_step`): a stack of
layers per kind, run in the checkpoint's order. Logits, greedy generation, loss and LoRA gradients against
transformers + peft; PEFT and merged export read back by them; conversion; the exports llama.cpp cannot read."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3MoeConfig

import jaxtune
from conftest import assert_greedy_tokens_are_transformers, build_hf_model, set_random_lora
from jaxtune.errors import UnsupportedModelError
from jaxtune.models.layer_kinds import layer_runs

SHAPES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts_per_tok=2, intermediate_size=96, moe_intermediate_size=64, num_experts=4,
              norm_topk_prob=True)
LAYOUTS = {"first-dense": {"mlp_only_layers": [0]}, "every-second-sparse": {"decoder_sparse_step": 2},
           "last-dense": {"mlp_only_layers": [3]}}


def _config(layout: str, **kw) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**SHAPES, **LAYOUTS[layout], **kw})


def _logits(model, ids) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(ids)))


def _assert_close(got, want, tol=1e-4):
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("layout, dense", [("first-dense", (0,)), ("every-second-sparse", (0, 2)),
                                           ("last-dense", (3,))])
def test_logits_equal_transformers(tmp_path, layout, dense):
    hf = build_hf_model(_config(layout), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert model.config.dense_mlp_layers == dense
    runs = layer_runs(model.config)  # consecutive layers of one kind run as one loop
    assert [r.stack.kind for r in runs for _ in range(r.count)] == [
        "dense_mlp" if i in dense else "decoder" for i in range(4)]
    assert len(runs) == {"first-dense": 2, "every-second-sparse": 4, "last-dense": 2}[layout]
    assert model.dense_mlp_layers.mlp.gate_proj.weight.shape == (len(dense), 96, 64)
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids)).logits.numpy()
    _assert_close(_logits(model, ids), want)


@pytest.mark.parametrize("layout", ["first-dense", "every-second-sparse"])
def test_greedy_generation_equals_transformers(tmp_path, layout, monkeypatch):
    """Prompts of different lengths, with the stacked KV cache and with one cache per layer."""
    hf = build_hf_model(_config(layout), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert_greedy_tokens_are_transformers(model, hf, [[5, 9, 17, 33], [7, 8]], monkeypatch)


@pytest.mark.parametrize("remat, options", [("selective", {}), ("selective", {"unroll": True}), ("offload", {}),
                                            ("none", {})])
def test_loss_and_lora_gradients_equal_peft_on_transformers(tmp_path, remat, options):
    """The adapters exported to PEFT and loaded by peft onto transformers: the same SFT loss, and the same gradient
    for an attention adapter of every layer and for the dense layers' MLP adapters, through the layer loop (its
    stacks, unrolled, remat offload's loops)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jaxtune.data.packing import IGNORE
    from jaxtune.training.objectives import SFT
    from jaxtune.training.step import loss_and_grads, split_model

    build_hf_model(_config("every-second-sparse"), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=False)
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1)
    set_random_lora(model, seed=2)
    jaxtune.save_peft(model, tmp_path / "peft")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft", is_trainable=True)
    ids = np.random.default_rng(3).integers(0, 128, (2, 12))
    labels = np.concatenate([ids[:, 1:], np.full((2, 1), IGNORE)], 1)
    batch = {"input_ids": ids, "labels": labels, "segment_ids": np.ones_like(ids),
             "positions": np.broadcast_to(np.arange(12), (2, 12))}
    model.remat_policy, model.unroll_layers = remat, bool(options.get("unroll"))
    graphdef, lora, frozen = split_model(model)
    with jax.default_matmul_precision("highest"):
        loss, grads, _ = jax.jit(lambda l, f, b: loss_and_grads(graphdef, l, f, b, None, 64, SFT()))(
            lora, frozen, {k: jnp.asarray(v, jnp.int32)[None] for k, v in batch.items()})
    out = peft_model(torch.as_tensor(ids), labels=torch.as_tensor(ids))
    out.loss.backward()
    assert float(loss) == pytest.approx(float(out.loss), rel=1e-5)
    layers = peft_model.base_model.model.model.layers
    checked = 0
    for i in range(4):
        stack, j = ("dense_mlp_layers", i // 2) if i % 2 == 0 else ("layers", i // 2)
        modules = [("self_attn", "q_proj"), ("self_attn", "o_proj")] + (
            [("mlp", "down_proj"), ("mlp", "gate_proj")] if stack == "dense_mlp_layers" else [])
        for parent, name in modules:
            torch_grad = getattr(getattr(layers[i], parent), name).lora_B["default"].weight.grad.numpy()
            got = np.asarray(grads[stack][parent][name]["lora_b"][j])
            np.testing.assert_allclose(got, torch_grad, rtol=2e-4, atol=1e-6 * np.abs(torch_grad).max())
            checked += 1
    assert checked == 12


def test_peft_and_merged_exports_load_in_transformers_with_jaxtunes_logits(tmp_path):
    """save_peft (the dense layers' MLP adapters on their weights, fused-parameter adapters on the experts) and
    save_merged: transformers (+ peft) give jaxtune's logits, and the adapter reads back into jaxtune."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    build_hf_model(_config("first-dense"), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=False)
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1)
    set_random_lora(model, seed=2)
    ids = np.random.default_rng(3).integers(0, 128, (2, 12))
    ours = _logits(model, ids)
    jaxtune.save_peft(model, tmp_path / "peft")
    jaxtune.save_merged(model, tmp_path / "merged", dtype="float32")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    # peft would read target_modules gate_proj as the experts' gate_up_proj: the dense MLP names its weights
    assert "mlp.gate_proj.weight" in config["target_parameters"] and "mlp.experts.gate_up_proj" in config[
        "target_parameters"] and "gate_proj" not in config["target_modules"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["mlp_only_layers"] == [0]
    with torch.no_grad():
        _assert_close(ours, peft_model(torch.as_tensor(ids)).logits.numpy())
        _assert_close(ours, merged(torch.as_tensor(ids)).logits.numpy())
        with peft_model.disable_adapter():
            assert np.abs(peft_model(torch.as_tensor(ids)).logits.numpy() - ours).max() > 1e-2
    fresh, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=False)
    jaxtune.load_peft(fresh, tmp_path / "peft")
    _assert_close(_logits(fresh, ids), ours, tol=1e-5)


def test_a_4bit_run_trains_both_kinds_of_layer_and_converts(tmp_path, tiny_tokenizer):
    """QLoRA at 4 bits (an 80-wide dense MLP keeps its down_proj 16-bit): the loss falls, the adapters of the dense
    layers and of the experts move; `jaxtune convert` writes both stacks' NF4 arrays, which load back to the same
    model; GGUF export is refused in one line, since llama.cpp's qwen3moe gives every layer experts."""
    build_hf_model(_config("every-second-sparse", vocab_size=len(tiny_tokenizer), intermediate_size=80),
                   tmp_path / "base")
    with pytest.warns(UserWarning, match="down_proj"):
        model, tok = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=48, micro_batch_size=4, max_steps=6, learning_rate=1e-2,
                              warmup_steps=0, lora_r=4, save_steps=0)
    result = jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False)
    assert result.losses[-1] < result.losses[0] - 0.1, result.losses
    for stack in (model.dense_mlp_layers.mlp.down_proj, model.layers.mlp.down_proj, model.dense_mlp_layers.mlp.up_proj):
        assert np.abs(np.asarray(stack.lora_b[...])).max() > 0
    jaxtune.convert(tmp_path / "base", tmp_path / "nf4", quantize="nf4", dtype="float32")
    with pytest.warns(UserWarning, match="down_proj"):
        direct, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    converted, _ = jaxtune.from_pretrained(tmp_path / "nf4", dtype="float32")
    ids = np.random.default_rng(4).integers(0, len(tiny_tokenizer), (1, 10))
    np.testing.assert_array_equal(_logits(direct, ids), _logits(converted, ids))
    with pytest.raises(UnsupportedModelError, match="dense MLP; export --merged instead") as e:
        jaxtune.save_gguf(model, tmp_path / "m.gguf", tokenizer=tok)
    assert "\n" not in str(e.value) and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("change, words", [
    ({"mlp_only_layers": [0, 1, 2, 3]}, "every layer's MLP dense"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"mlp_only_layers": [7]}, "layer indices below 4"),
])
def test_layer_options_that_name_no_model_are_refused_in_one_line(tmp_path, change, words):
    build_hf_model(_config("first-dense"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=words) as e:
        jaxtune.from_pretrained(tmp_path)
    assert "\n" not in str(e.value)
