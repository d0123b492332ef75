"""The routed experts' MLP with its own VJP (jaxtune/moe/expert_mlp.py): output and every gradient (tokens, routing
weights, LoRA factors) against a float64 dense per-token reference, through both grouped-GEMM implementations;
and under remat "selective" the backward runs no frozen expert GEMM forward again."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxtune
from conftest import build_hf_model
from jaxtune.moe.expert_mlp import ExpertMLPSpec, ExpertProjection, expert_mlp, expert_mlp_reference
from jaxtune.moe.layout import tile_layout

HIDDEN, INTER, R = 32, 48, 4


def _dense_reference(x, weights, experts, projections, spec):
    """Each token's k experts computed one by one (each token's expert weights gathered), float64 under x64."""
    def proj(v, p, scale, e):  # v [N, k, in]
        y = jnp.einsum("nki,nkoi->nko", v, p["weight"][e])
        if "bias" in p:
            y = y + p["bias"][e]
        if "lora_a" in p:
            y = y + scale * jnp.einsum("nkr,nkor->nko", jnp.einsum("nki,nkri->nkr", v, p["lora_a"][e]),
                                       p["lora_b"][e])
        return y

    gate_p, up_p, down_p = projections
    v = jnp.broadcast_to(x[:, None, :], (x.shape[0], spec.top_k, x.shape[1]))
    gate, up = proj(v, gate_p, spec.scales[0], experts), proj(v, up_p, spec.scales[1], experts)
    if spec.activation == "clamped_swiglu":
        g = jnp.minimum(gate, spec.swiglu_limit)
        h = (jnp.clip(up, -spec.swiglu_limit, spec.swiglu_limit) + 1) * g * jax.nn.sigmoid(spec.swiglu_alpha * g)
    else:
        h = jax.nn.silu(gate) * up
    return jnp.einsum("nko,nk->no", proj(h, down_p, spec.scales[2], experts), weights)


def _projection(rng, experts, out, inp, lora: bool, bias: bool) -> dict:
    p = {"weight": rng.standard_normal((experts, out, inp)) / np.sqrt(inp)}
    if bias:
        p["bias"] = 0.1 * rng.standard_normal((experts, out))
    if lora:
        p["lora_a"] = rng.standard_normal((experts, R, inp)) / np.sqrt(inp)
        p["lora_b"] = 0.5 * rng.standard_normal((experts, out, R))
    return p


@pytest.mark.parametrize("kernels", ["xla", "pallas-interpret"])
@pytest.mark.parametrize("tokens, top_k, experts, activation, lora, bias", [
    (13, 2, 4, "swiglu", (True, True, True), False),
    (40, 8, 12, "swiglu", (True, False, True), False),  # up without an adapter
    (5, 1, 6, "clamped_swiglu", (True, True, True), True),  # gpt-oss: expert biases, clamped SwiGLU
    (24, 2, 8, "swiglu", (False, False, False), False),  # frozen experts: gradients to the tokens and weights
])
def test_expert_mlp_and_its_gradients_equal_a_float64_dense_reference(kernels, tokens, top_k, experts, activation,
                                                                       lora, bias):
    rng = np.random.default_rng(tokens * top_k)
    # the last two experts unused (empty groups); uneven groups elsewhere
    chosen = np.stack([rng.choice(experts - 2, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    x = rng.standard_normal((tokens, HIDDEN))
    weights = rng.uniform(0.1, 1.0, (tokens, top_k))
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    params = [_projection(rng, experts, o, i, lo, bias) for (o, i), lo in zip(shapes, lora)]
    dout = rng.standard_normal((tokens, HIDDEN))
    scales = (2.0, 0.5, 1.5)
    layout = tile_layout(jnp.asarray(chosen), experts, block_m=16)
    spec = ExpertMLPSpec(top_k, layout.rows, layout.block_m, activation, 1.702, 1.5 if bias else 7.0, scales)

    def ours(x, weights, lora_factors):
        projections = tuple(ExpertProjection(jnp.asarray(p["weight"], jnp.float32),
                                             None if "bias" not in p else jnp.asarray(p["bias"], jnp.float32),
                                             *(f if f is not None else (None, None)))
                            for p, f in zip(params, lora_factors))
        return expert_mlp(x, weights, layout, projections, spec)

    factors = tuple((jnp.asarray(p["lora_a"], jnp.float32), jnp.asarray(p["lora_b"], jnp.float32))
                    if "lora_a" in p else None for p in params)
    jaxtune.set_kernels(kernels)
    try:
        with jax.default_matmul_precision("highest"):
            y, vjp = jax.vjp(ours, jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), factors)
            dx, dw, dfactors = vjp(jnp.asarray(dout, jnp.float32))
    finally:
        jaxtune.set_kernels(None)

    with jax.enable_x64(True):
        def reference(x, weights, lora_factors):
            full = [{**p, **({} if f is None else {"lora_a": f[0], "lora_b": f[1]})}
                    for p, f in zip(params, lora_factors)]
            return _dense_reference(x, weights, jnp.asarray(chosen), full, spec)

        factors64 = tuple(None if f is None else tuple(jnp.asarray(np.asarray(a), jnp.float64) for a in f)
                          for f in factors)
        want, ref_vjp = jax.vjp(reference, jnp.asarray(x), jnp.asarray(weights), factors64)
        want_grads = ref_vjp(jnp.asarray(dout))
        want, want_grads = np.asarray(want), jax.tree.map(np.asarray, want_grads)

    def close(got, want):
        got = np.asarray(got, np.float64)
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())

    close(y, want)
    close(dx, want_grads[0])
    close(dw, want_grads[1])
    assert jax.tree.structure(dfactors) == jax.tree.structure(want_grads[2])
    for got, ref in zip(jax.tree.leaves(dfactors), jax.tree.leaves(want_grads[2])):
        close(got, ref)


def test_lora_dropout_masks_the_same_inputs_in_forward_and_backward():
    """With dropout keys, the VJP's gradients equal autodiff of the plain composition under the same keys."""
    rng = np.random.default_rng(3)
    tokens, top_k, experts = 21, 2, 5
    chosen = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    layout = tile_layout(chosen, experts, block_m=16)
    spec = ExpertMLPSpec(top_k, layout.rows, 16, scales=(2.0, 2.0, 2.0), dropouts=(0.3, 0.5, 0.2))
    params = [_projection(rng, experts, o, i, True, False)
              for o, i in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))]
    keys = tuple(jax.random.key(i) for i in range(3))
    x = jnp.asarray(rng.standard_normal((tokens, HIDDEN)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)), jnp.float32)
    factors = tuple((jnp.asarray(p["lora_a"], jnp.float32), jnp.asarray(p["lora_b"], jnp.float32)) for p in params)

    def run(fn):
        def loss(x, weights, factors):
            projections = tuple(ExpertProjection(jnp.asarray(p["weight"], jnp.float32), None, *f)
                                for p, f in zip(params, factors))
            return jnp.sum(jnp.sin(fn(x, weights, layout, projections, spec, keys)))
        with jax.default_matmul_precision("highest"):
            return jax.grad(loss, argnums=(0, 1, 2))(x, weights, factors)

    got, want = run(expert_mlp), run(expert_mlp_reference)
    no_dropout = jax.grad(lambda x: jnp.sum(jnp.sin(expert_mlp(x, weights, layout, tuple(
        ExpertProjection(jnp.asarray(p["weight"], jnp.float32), None, *f) for p, f in zip(params, factors)),
        spec))))(x)
    assert np.abs(np.asarray(no_dropout) - np.asarray(want[0])).max() > 1e-3  # the masks change the gradients
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * np.abs(np.asarray(w)).max())


def test_selective_remat_runs_every_frozen_expert_gemm_once_each_way(tmp_path, monkeypatch):
    """A Qwen3-MoE layer's backward under remat "selective" runs the frozen experts' three input-gradient GEMMs and
    no forward GEMM again (as with no remat); "per-layer" remat runs the three forward ones again."""
    from transformers import Qwen3MoeConfig

    from jaxtune.ops import dispatch
    from test_kernel_dispatch import kernel_name, live_eqns

    monkeypatch.setattr(dispatch, "_mode", "pallas-interpret")
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=48,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    build_hf_model(config, tmp_path)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (1, 24)))
    rank = 4

    def frozen_gemm(eqn) -> bool:  # a grouped GEMM whose operands are not LoRA's rank-r ones
        if kernel_name(eqn) != "grouped_matmul":
            return False
        x, w = eqn.invars[1].aval.shape, eqn.invars[2].aval.shape
        return rank not in (x[-1], w[-1], w[-2])

    from jaxtune.moe import block, expert_mlp as fused

    def count(policy: str) -> int:
        model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
        jaxtune.get_peft_model(model, r=rank, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
        model.remat_policy = policy
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(ids))))(lora).jaxpr
        return live_eqns(jaxpr, frozen_gemm)

    counts = {policy: count(policy) for policy in ("none", "selective", "full")}
    # the layer scan's body: 3 forward, 3 input gradients; per-layer remat runs gate and up forward again (down's
    # output is not a residual)
    assert counts == {"none": 6, "selective": 6, "full": 8}, counts
    monkeypatch.setattr(block, "expert_mlp", fused.expert_mlp_reference)  # autodiff of the plain composition
    assert count("selective") > 6
