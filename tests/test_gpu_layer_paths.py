"""Compiled on the GPU: one decoder layer's loss and LoRA gradients through each kernel mode against XLA's, in float32,
at the layer shapes of Llama-3.2-1B (head dim 64, MLP 8192) and Llama-3-8B (head dim 128, MLP 14336), packed rows
included. Interpret mode checks the kernels' logic on CPU; this checks what Triton and cuDNN make of them at the
shapes users train."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtune
from jaxtune.config import ModelConfig
from jaxtune.model import init_model
from jaxtune.qlora import quantize_layers
from jaxtune.training.step import split_model

LAYERS = {  # hidden, MLP, heads, KV heads, head dim
    "llama3.2-1b": (2048, 8192, 32, 8, 64),
    "llama3-8b": (4096, 14336, 32, 8, 128),
}


def _loss_and_grads(split, hidden: int, kernels: str, packed: bool):
    graphdef, lora, frozen = split
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 512, (2, 256)), jnp.int32)
    if packed:
        seg = jnp.asarray(np.concatenate([np.ones((2, 160)), 2 * np.ones((2, 96))], 1), jnp.int32)
        pos = jnp.asarray(np.concatenate([np.arange(160), np.arange(96)])[None].repeat(2, 0), jnp.int32)
    else:
        seg, pos = jnp.ones((2, 256), jnp.int32), jnp.asarray(np.arange(256)[None].repeat(2, 0), jnp.int32)
    readout = jax.random.normal(jax.random.key(7), (hidden,), jnp.float32)

    def loss(lora):
        h = nnx.merge(graphdef, lora, frozen).hidden_states(ids, pos, seg)
        return jnp.mean(jnp.tanh(h.astype(jnp.float32) @ readout))

    jaxtune.set_kernels(kernels)
    try:
        value, grads = jax.jit(jax.value_and_grad(loss))(lora)
    finally:
        jaxtune.set_kernels(None)
    return float(value), {tuple(p): np.asarray(g.get_value(), np.float32) for p, g in nnx.to_flat_state(grads)}


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shapes", list(LAYERS))
def test_each_kernel_mode_gives_xlas_loss_and_gradients_on_the_gpu(shapes, packed):
    check_kernel_modes(*LAYERS[shapes], packed=packed, modes=("auto", "pallas"))


def check_kernel_modes(hidden: int, mlp: int, heads: int, kv_heads: int, head_dim: int, packed: bool,
                       modes: tuple[str, ...]) -> None:
    cfg = ModelConfig(model_type="llama", vocab_size=512, hidden_size=hidden, intermediate_size=mlp, num_layers=1,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, eos_token_id=1)
    model = quantize_layers(init_model(cfg, dtype="float32", seed=0))
    jaxtune.get_peft_model(model, r=8, lora_alpha=16)
    lora = nnx.state(model, nnx.LoRAParam)  # B away from zero, so every factor has a gradient
    nnx.update(model, jax.tree.map(lambda a: a + 0.01 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), lora))
    split = split_model(model)
    jax.config.update("jax_default_matmul_precision", "highest")  # float32 products, not TF32, on XLA's side
    try:
        want_loss, want = _loss_and_grads(split, hidden, "xla", packed)
        for kernels in modes:
            loss, got = _loss_and_grads(split, hidden, kernels, packed)
            assert loss == pytest.approx(want_loss, rel=1e-3), kernels
            for path, w in want.items():
                scale = np.abs(w).max()
                assert scale > 0, path
                err = np.abs(got[path] - w).max() / scale
                assert err < 2e-2, (kernels, path, err)
    finally:
        jax.config.update("jax_default_matmul_precision", None)
