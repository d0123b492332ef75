"""QLoRA model: NF4 projections + LoRA adapters match HF + PEFT on the same dequantized base."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, Qwen2Config

import jaxtune
from conftest import build_hf_model, peft_reference, set_random_lora
from jaxtune.quant import nf4
from jaxtune.qlora import LORA_TARGETS, get_peft_model

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


@pytest.mark.parametrize("hf_config, r, alpha, rslora, targets", [
    (LlamaConfig(**COMMON), 8, 16, False, LORA_TARGETS),
    (LlamaConfig(**COMMON, tie_word_embeddings=True), 4, 32, True, ("q_proj", "v_proj")),
    (Qwen2Config(**COMMON), 16, 8, False, ("k_proj", "o_proj", "down_proj")),
])
def test_qlora_logits_equal_peft(tmp_path, hf_config, r, alpha, rslora, targets):
    hf_model = build_hf_model(hf_config, tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32", load_in_4bit=True)
    get_peft_model(model, r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, seed=1)
    set_random_lora(model, seed=2)  # non-zero B, so the adapters change the output
    ref_model = peft_reference(hf_model, model, r=r, alpha=alpha, rslora=rslora, targets=targets)
    ids = np.random.default_rng(3).integers(0, 128, size=(2, 12))
    with torch.no_grad():
        ref = ref_model(torch.as_tensor(ids)).logits.numpy()
    ours = np.asarray(model(ids))
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)


def test_load_in_4bit_keeps_embeddings_bf16_and_only_lora_trains(tmp_path):
    build_hf_model(LlamaConfig(**COMMON), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, load_in_4bit=True)
    assert model.embed_tokens.weight[...].dtype == np.dtype("bfloat16")
    assert model.layers.mlp.up_proj.codes[...].dtype == np.uint8
    assert model.layers.mlp.up_proj.codes[...].shape == (2, 128, 32)
    get_peft_model(model, r=4)
    lora = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    assert len(lora) == 2 * len(LORA_TARGETS)
    assert all(path[-1] in ("lora_a", "lora_b") for path, _ in lora)
    a = model.layers.self_attn.q_proj.lora_a[...]
    assert a.shape == (2, 4, 64) and np.abs(np.asarray(a)).max() <= 1 / np.sqrt(64)  # kaiming-uniform bound
    assert not np.asarray(model.layers.self_attn.q_proj.lora_b[...]).any()


def test_unknown_target_module_lists_valid_ones(tmp_path):
    build_hf_model(LlamaConfig(**COMMON), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, load_in_4bit=True)
    with pytest.raises(ValueError) as e:
        get_peft_model(model, target_modules=("q_proj", "qkv"))
    assert "qkv" in str(e.value) and "gate_proj" in str(e.value) and "\n" not in str(e.value)


def test_lora_dropout_applies_only_with_an_rng(tmp_path):
    import jax
    import jax.numpy as jnp

    build_hf_model(LlamaConfig(**COMMON), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32", load_in_4bit=True)
    get_peft_model(model, r=4, lora_dropout=0.5)
    set_random_lora(model, seed=5)
    ids = np.random.default_rng(6).integers(0, 128, size=(1, 8))
    no_dropout = np.asarray(model(ids))
    key = jax.random.key(0)
    a = np.asarray(model(ids, dropout_rng=key))
    b = np.asarray(model(ids, dropout_rng=key))
    c = np.asarray(model(ids, dropout_rng=jax.random.key(1)))
    np.testing.assert_array_equal(a, b)  # same key, same mask
    assert np.abs(a - no_dropout).max() > 1e-3 and np.abs(a - c).max() > 1e-3
    # one adapter checked against the formula: base(x) + s * B A (x * mask / (1 - p))
    proj = model.layers.self_attn.q_proj
    x = jnp.asarray(np.random.default_rng(7).standard_normal((2, 3, 64)), jnp.float32)
    rng = jax.random.key(3)
    keep = np.asarray(jax.random.bernoulli(rng, 0.5, x.shape))
    a0, b0 = np.asarray(proj.lora_a[...])[0], np.asarray(proj.lora_b[...])[0]
    w0 = np.asarray(nf4.dequantize(proj.base.weight_nf4))[0]
    want = np.asarray(x) @ w0.T + proj.scale * ((np.asarray(x) * keep / 0.5) @ a0.T) @ b0.T
    graphdef, state = nnx.split(proj)
    one = nnx.merge(graphdef, jax.tree.map(lambda v: v[0], state))
    np.testing.assert_allclose(np.asarray(one(x, rng)), want, rtol=1e-5, atol=1e-5)


def test_nf4_linear_gradient_matches_dense():
    import jax
    import jax.numpy as jnp

    from jaxtune import ops

    rng = np.random.default_rng(0)
    q = nf4.quantize((rng.standard_normal((96, 128)) * 0.05).astype(np.float32))
    w = nf4.dequantize(q)
    x = jnp.asarray(rng.standard_normal((3, 5, 128)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((3, 5, 96)), jnp.float32)
    y, vjp = jax.vjp(lambda x_: ops.nf4_linear(x_, q), x)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vjp(dy)[0], dy @ w, rtol=1e-5, atol=1e-6)
    # the gradient goes through the custom VJP, which saves the NF4 arrays rather than a float copy of W
    jaxpr = jax.make_jaxpr(jax.grad(lambda x_: ops.nf4_linear(x_, q).sum()))(x)
    assert "custom_vjp_call" in str(jaxpr)
