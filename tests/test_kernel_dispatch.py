"""Kernel dispatch: `JAXTUNE_KERNELS` / `set_kernels`, and the model run through the Pallas kernels
(interpret mode) giving the same logits and LoRA gradients as the XLA reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtune
from jaxtune import dispatch
from jaxtune.config import ModelConfig
from jaxtune.errors import JaxtuneError
from jaxtune.model import init_model
from jaxtune.qlora import get_peft_model, quantize_layers


@pytest.fixture(autouse=True)
def reset_mode(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    yield
    jaxtune.set_kernels(None)


def test_mode_from_env_and_setter(monkeypatch):
    assert jaxtune.kernel_mode() == "auto"
    monkeypatch.setenv("JAXTUNE_KERNELS", "xla")
    assert jaxtune.kernel_mode() == "xla"
    jaxtune.set_kernels("pallas-interpret")
    assert jaxtune.kernel_mode() == "pallas-interpret" and dispatch.interpret()
    jaxtune.set_kernels(None)
    assert jaxtune.kernel_mode() == "xla"
    monkeypatch.setenv("JAXTUNE_KERNELS", "triton")
    with pytest.raises(JaxtuneError, match="unknown kernel mode 'triton'.*auto, xla, pallas"):
        jaxtune.kernel_mode()
    with pytest.raises(JaxtuneError, match="set_kernels"):
        jaxtune.set_kernels("fast")


def test_auto_uses_xla_on_cpu_and_the_measured_table_on_gpu(monkeypatch):
    assert dispatch.nf4_impl(1) == "xla" and dispatch.attention_impl() == "xla"
    monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
    assert [dispatch.nf4_impl(m) for m in (1, 16, 17, 2048)] == ["fused", "fused", "dequant+dot", "dequant+dot"]
    assert dispatch.attention_impl() == "pallas"
    jaxtune.set_kernels("cudnn")
    assert dispatch.attention_impl() == "cudnn"
    jaxtune.set_kernels("xla")
    assert dispatch.nf4_impl(1) == "xla" and dispatch.attention_impl() == "xla"
    jaxtune.set_kernels("pallas")
    assert dispatch.nf4_impl(4096) == "fused"


def kernel_model():
    """2-layer QLoRA Llama whose shapes the kernels take: head_dim 64, GQA 2:1, dims multiples of 64."""
    cfg = ModelConfig(model_type="llama", vocab_size=320, hidden_size=128, intermediate_size=192, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=64)
    model = get_peft_model(quantize_layers(init_model(cfg, dtype="float32", seed=0)), r=4, seed=1)
    lora = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda p: p + 0.02 * jax.random.normal(jax.random.key(2), p.shape, p.dtype), lora))
    return model


def logits_and_grads(model, ids, seg):
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(lora):
        logits = nnx.merge(graphdef, lora, rest)(ids, segment_ids=seg)
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(lora)
    return logits, grads, jax.make_jaxpr(loss)(lora)


def test_model_with_pallas_kernels_matches_xla():
    model = kernel_model()
    ids = jax.random.randint(jax.random.key(0), (2, 45), 0, 320)
    seg = jnp.asarray(np.array([[1] * 20 + [2] * 19 + [0] * 6, [1] * 7 + [2] * 30 + [3] * 8]), jnp.int32)
    jaxtune.set_kernels("xla")
    ref_logits, ref_grads, ref_jaxpr = logits_and_grads(model, ids, seg)
    jaxtune.set_kernels("pallas-interpret")
    logits, grads, jaxpr = logits_and_grads(model, ids, seg)
    assert "pallas_call" not in str(ref_jaxpr)
    assert str(jaxpr).count("pallas_call") >= 2  # flash attention and the fused NF4 matmul ran
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=2e-5, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-4)
