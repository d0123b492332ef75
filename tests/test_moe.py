"""Mixture of experts (Qwen3-MoE, Mixtral): the grouped expert GEMM against float64, logits against transformers,
NF4 experts against bitsandbytes, per-expert LoRA against transformers on the merged weights, and training."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig

import jaxtune
from conftest import build_hf_model
from jaxtune.errors import UnsupportedModelError
from jaxtune.moe.grouped import grouped_matmul, grouped_matmul_reference
from jaxtune.moe.routing import group_by_expert, route

SHAPES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_moe": lambda **kw: Qwen3MoeConfig(**{**SHAPES, "intermediate_size": 128, "moe_intermediate_size": 64,
                                                "num_experts": 8, "norm_topk_prob": True, **kw}),
    "qwen3_moe-unnormalized": lambda **kw: Qwen3MoeConfig(**{**SHAPES, "intermediate_size": 128, "num_experts": 4,
                                                             "moe_intermediate_size": 64, "norm_topk_prob": False,
                                                             **kw}),
    "mixtral": lambda **kw: MixtralConfig(**{**SHAPES, "intermediate_size": 64, "num_local_experts": 4, **kw}),
}

@pytest.mark.parametrize("rows, experts, k, n", [(13, 4, 8, 5), (64, 8, 64, 128), (7, 5, 16, 3)])
def test_grouped_matmul_and_its_gradients_equal_float64_with_uneven_and_empty_groups(rows, experts, k, n):
    rng = np.random.default_rng(rows)
    sizes = rng.multinomial(rows, rng.dirichlet(np.full(experts, 0.3)))
    sizes[0], sizes[-1] = 0, sizes[-1] + sizes[0]  # at least one empty group, the rows unchanged
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((experts, n, k)).astype(np.float32)
    dy = rng.standard_normal((rows, n)).astype(np.float32)
    with jax.default_matmul_precision("highest"):
        y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, jnp.asarray(sizes)), jnp.asarray(x), jnp.asarray(w))
        dx, dw = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(y), grouped_matmul_reference(x, w, sizes), rtol=1e-5, atol=1e-5)
    # the gradients: dx = dy @ W[e] per row's group, dW[e] = dy[group e].T @ x[group e] (zero for empty groups)
    start, want_dx, want_dw = 0, np.zeros(x.shape), np.zeros(w.shape)
    for e, m in enumerate(sizes):
        rows_e = slice(start, start + m)
        want_dx[rows_e] = dy[rows_e].astype(np.float64) @ w[e].astype(np.float64)
        want_dw[e] = dy[rows_e].astype(np.float64).T @ x[rows_e].astype(np.float64)
        start += m
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-5)
    assert not np.asarray(dw)[0].any()  # an empty group gets no gradient


def test_routing_groups_every_routed_row_by_expert():
    x = jax.random.normal(jax.random.key(0), (10, 16))
    router = jax.random.normal(jax.random.key(1), (6, 16))
    r = route(x, router, 3, normalize=True)
    probs = np.asarray(jax.nn.softmax(np.asarray(x, np.float64) @ np.asarray(router, np.float64).T, axis=-1))
    top = np.argsort(-probs, axis=-1)[:, :3]
    np.testing.assert_array_equal(np.asarray(r.experts), top)
    np.testing.assert_allclose(np.asarray(r.weights), np.take_along_axis(probs, top, -1)
                               / np.take_along_axis(probs, top, -1).sum(-1, keepdims=True), rtol=1e-5)
    g = group_by_expert(r.experts, 6)
    experts = np.asarray(r.experts).reshape(-1)[np.asarray(g.order)]
    assert (np.diff(experts) >= 0).all() and np.asarray(g.sizes).sum() == 30
    np.testing.assert_array_equal(np.asarray(g.sizes), np.bincount(np.asarray(r.experts).reshape(-1), minlength=6))
    np.testing.assert_array_equal(np.asarray(g.order)[np.asarray(g.inverse)], np.arange(30))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_equal_transformers(tmp_path, family):
    hf = build_hf_model(CONFIGS[family](), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert model.config.num_experts == hf.config.num_experts if family != "mixtral" else hf.config.num_local_experts
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_nf4_experts_are_bitsandbytes_bytes_per_expert(tmp_path):
    """Each expert's weight quantized on its own, as bitsandbytes quantizes that expert's Linear: the same 4-bit
    codes, and absmax codes within one step on few blocks (bnb's CPU rounding, as for dense projections)."""
    from bitsandbytes import functional as F

    hf = build_hf_model(CONFIGS["mixtral"](), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32", load_in_4bit=True)
    experts = model.layers.mlp.down_proj
    assert type(experts).__name__ == "NF4Experts" and experts.codes[...].shape == (2, 4, 64, 32)
    assert model.layers.mlp.router.weight[...].dtype == jnp.float32  # the router stays in the model dtype
    for layer in range(2):
        for e in range(4):
            w = hf.model.layers[layer].mlp.experts.down_proj[e].detach().contiguous()
            q, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
            np.testing.assert_array_equal(np.asarray(experts.codes[...][layer, e]).reshape(-1), q.numpy().reshape(-1))
            diff = np.abs(np.asarray(experts.absmax_codes[...][layer, e]).astype(int) - state.absmax.numpy().astype(int))
            assert diff.max() <= 1


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_lora_equals_transformers_on_the_merged_weights(tmp_path, family):
    """LoRA on attention and on every expert's gate/up/down (one adapter per expert): the logits of
    transformers with W + s * B @ A written into each projection (the NF4 base dequantized)."""
    from conftest import set_random_lora

    hf = build_hf_model(CONFIGS[family](), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1)
    set_random_lora(model, seed=2)
    assert model.layers.mlp.gate_proj.lora_a[...].shape == (2, model.config.num_experts, 4, 64)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            merged = np.asarray(getattr(model.layers.self_attn, name).merged_weight())
            for i, layer in enumerate(hf.model.layers):
                getattr(layer.self_attn, name).weight.copy_(torch.from_numpy(merged[i].copy()))
        gate, up, down = (np.asarray(getattr(model.layers.mlp, n).merged_weight()) for n in ("gate_proj", "up_proj",
                                                                                              "down_proj"))
        for i, layer in enumerate(hf.model.layers):
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate[i], up[i]], axis=1).copy()))
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(down[i].copy()))
        ids = np.random.default_rng(3).integers(0, 128, (2, 12))
        want = hf(torch.as_tensor(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def test_a_qwen3_moe_qlora_run_trains_the_expert_adapters(tmp_path, tiny_tokenizer):
    config = CONFIGS["qwen3_moe"](vocab_size=len(tiny_tokenizer))
    build_hf_model(config, tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=48, micro_batch_size=4, max_steps=6, learning_rate=1e-2,
                              warmup_steps=0, lora_r=4, save_steps=0)
    result = jaxtune.train(model, tiny_tokenizer, rows, cfg, out_dir=tmp_path / "run", progress=False)
    assert result.losses[-1] < result.losses[0] - 0.1, result.losses
    b = np.asarray(model.layers.mlp.down_proj.lora_b[...])
    trained = (np.abs(b).reshape(2, 8, -1).max(-1) > 0).sum(-1)  # per layer: experts whose adapter moved
    assert (trained >= 6).all(), trained  # the experts the router sent tokens to (all but the odd unused one)


@pytest.mark.parametrize("change, words", [
    ({"mlp_only_layers": [0]}, "dense MLP layers among the sparse ones"),
    ({"decoder_sparse_step": 2}, "dense MLP layers among the sparse ones"),
    ({"num_experts_per_tok": 9}, "1 <= num_experts_per_tok <= num_experts"),
])
def test_unsupported_routing_options_are_refused_in_one_line_before_loading(tmp_path, change, words):
    build_hf_model(CONFIGS["qwen3_moe"](), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=words) as e:
        jaxtune.from_pretrained(tmp_path)
    assert "\n" not in str(e.value)


def test_exports_a_moe_model_cannot_write_yet_are_refused_in_one_line(tmp_path):
    build_hf_model(CONFIGS["mixtral"](), tmp_path / "base")
    model, tok = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(model, r=4)
    for export in (lambda: jaxtune.save_peft(model, tmp_path / "peft"),
                   lambda: jaxtune.save_merged(model, tmp_path / "merged"),
                   lambda: jaxtune.save_gguf(model, tmp_path / "m.gguf", tokenizer=tok)):
        with pytest.raises(UnsupportedModelError, match="mixture-of-experts") as e:
            export()
        assert "\n" not in str(e.value)
    assert not list(tmp_path.glob("peft*")) + list(tmp_path.glob("merged*")) + list(tmp_path.glob("m.gguf"))
