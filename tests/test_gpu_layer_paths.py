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
from jaxtune.models.config import ModelConfig
from jaxtune.models.causal_lm import init_model
from jaxtune.qlora import quantize_layers
from jaxtune.training.step import split_model

LAYERS = {  # hidden, MLP, heads, KV heads, head dim
    "llama3.2-1b": (2048, 8192, 32, 8, 64),
    "llama3-8b": (4096, 14336, 32, 8, 128),
}


def _config(hidden: int, mlp: int, heads: int, kv_heads: int, head_dim: int, layers: int) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=512, hidden_size=hidden, intermediate_size=mlp,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, eos_token_id=1)


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
    cfg = _config(hidden, mlp, heads, kv_heads, head_dim, layers=1)
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n, k", [(512, 2048), (8192, 2048), (2048, 8192)])
def test_every_layer_of_a_stack_through_the_kernels_inside_a_scan_on_the_gpu(dtype, n, k):
    """A layer scan over a stack of four NF4 weights with their own codes and scales, each read in place by its
    layer index as training reads it (the prepared scales' stack): the dequant kernel (W and Wᵀ) and the fused
    forward and input-gradient kernels at decode and training row counts give each layer's own result. A model of
    one layer cannot tell a kernel that reads the wrong layer from a right one."""
    from jaxtune.quant import nf4
    from jaxtune.ops.nf4_linear import kernel_tiles
    from pallas_kernels.nf4_dequant import nf4_dequantize
    from pallas_kernels.nf4_matmul import nf4_matmul_dx, nf4_matmul_forward

    layers = 4
    rng = np.random.default_rng(0)
    parts = [nf4.quantize(rng.standard_normal((n, k)).astype(np.float32) * (0.02 * (i + 1))) for i in range(layers)]
    stack = jnp.stack([jnp.asarray(q.codes) for q in parts])
    absmax = [np.asarray(nf4.dequantize_absmax(q)).reshape(n, k // 64) for q in parts]
    prepared = jnp.stack([jnp.asarray(a.T) for a in absmax])
    weights = [np.asarray(nf4.dequantize(q, jnp.float32), np.float64) for q in parts]

    def each_layer(fn):
        return jax.jit(lambda *a: jax.lax.scan(lambda c, i: (c, fn(i, *a)), 0, jnp.arange(layers, dtype=jnp.int32))[1])

    got = each_layer(lambda i, c, a: nf4_dequantize(c, a, dtype, layer=i))(stack, prepared)
    got_t = each_layer(lambda i, c, a: nf4_dequantize(c, a, dtype, transpose=True, layer=i))(stack, prepared)
    for i, w in enumerate(weights):
        np.testing.assert_allclose(np.asarray(got[i], np.float64), w, rtol=1e-2, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got_t[i], np.float64), w.T, rtol=1e-2, atol=1e-6)
    for m in (16, 64, 1024):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
        fwd = kernel_tiles(m, "fwd", (n, k), dtype)
        dxt = kernel_tiles(m, "dx", dtype=dtype)
        y = each_layer(lambda i, x, c, a: nf4_matmul_forward(x, c, a, tiles=fwd, layer=i))(x, stack, prepared)
        dx = each_layer(lambda i, d, c, a: nf4_matmul_dx(d, c, a, tiles=dxt, layer=i))(dy, stack, prepared)
        for i, w in enumerate(weights):
            y_want = np.asarray(x, np.float64) @ w.T
            dx_want = np.asarray(dy, np.float64) @ w
            for name, g, want in (("forward", y[i], y_want), ("dx", dx[i], dx_want)):
                err = np.abs(np.asarray(g, np.float64) - want).max() / np.abs(want).max()
                assert err < 2e-2, (name, m, i, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_four_layer_model_trains_alike_under_each_kernel_mode_on_the_gpu(dtype):
    """Twenty optimizer steps of a four-layer model at Llama-3.2-1B's shapes learning a fixed batch: each kernel
    mode's losses follow XLA's. A fault that parts the modes only past one layer (a layer read wrongly, a gradient
    that is not the forward's) shows as a loss that stops falling."""
    import optax

    cfg = _config(*LAYERS["llama3.2-1b"], layers=4)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (16, 64)), jnp.int32)
    seg = jnp.asarray(np.repeat(np.arange(1, 5), 16)[None].repeat(16, 0), jnp.int32)
    pos = jnp.asarray(np.tile(np.arange(16), 4)[None].repeat(16, 0), jnp.int32)

    def curve(kernels: str) -> list[float]:
        model = quantize_layers(init_model(cfg, dtype=dtype, seed=0))
        jaxtune.get_peft_model(model, r=16, lora_alpha=32)
        graphdef, lora, frozen = split_model(model)
        opt = optax.adam(2e-3)

        def loss(lora):
            logits = nnx.merge(graphdef, lora, frozen)(ids[:, :-1], pos[:, :-1], seg[:, :-1]).astype(jnp.float32)
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], -1))

        @jax.jit
        def step(lora, state):
            value, grads = jax.value_and_grad(loss)(lora)
            updates, state = opt.update(grads, state, lora)
            return optax.apply_updates(lora, updates), state, value

        jaxtune.set_kernels(kernels)
        try:
            state, values = opt.init(lora), []
            for _ in range(20):
                lora, state, value = step(lora, state)
                values.append(float(value))
        finally:
            jaxtune.set_kernels(None)
        return values

    want = curve("xla")
    assert want[-1] < 0.8 * want[0], want
    for kernels in ("auto", "pallas"):
        got = curve(kernels)
        assert got[-1] < 0.8 * got[0] and abs(got[-1] - want[-1]) < 0.1 * want[0], (kernels, got, want)
