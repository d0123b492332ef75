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
        if kernel_name(eqn) not in ("grouped_matmul", "grouped_matmul_gathered"):  # rows as they are, or by index
            return False
        x, w = eqn.invars[-2].aval.shape, eqn.invars[-1].aval.shape
        return rank not in (x[-1], w[-1], w[-2])

    from jaxtune.moe import block, expert_mlp as fused

    def count(policy: str, matches=frozen_gemm) -> int:
        model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
        jaxtune.get_peft_model(model, r=rank, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
        model.remat_policy = policy
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(ids))))(lora).jaxpr
        return live_eqns(jaxpr, matches)

    # gate and up (frozen and LoRA's A) load their rows from the tokens by index: no routed copy in the forward
    assert count("selective", lambda e: kernel_name(e) == "grouped_matmul_gathered") == 4

    # LoRA products from the rank to the hidden size: down's term forward, gate's and up's input gradients; the
    # routing weights' gradient takes down's term from the rank (<u, dr B>), not from its [rows, hidden] output
    def rank_to_hidden(eqn) -> bool:
        return (kernel_name(eqn) == "grouped_matmul" and eqn.invars[-2].aval.shape[-1] == rank
                and eqn.outvars[0].aval.shape[-1] == config.hidden_size)

    assert count("selective", rank_to_hidden) == 3

    counts = {policy: count(policy) for policy in ("none", "selective", "selective-experts", "full")}
    # the layer scan's body: 3 forward, 3 input gradients; per-layer remat, and "recompute-experts" (selective but
    # the routed rows), run gate and up forward again (down's output is not a residual)
    assert counts == {"none": 6, "selective": 6, "selective-experts": 8, "full": 8}, counts
    monkeypatch.setattr(block, "expert_mlp", fused.expert_mlp_reference)  # autodiff of the plain composition
    assert count("selective") > 6


@pytest.mark.parametrize("kernels", ["xla", "pallas-interpret"])
def test_fp8_experts_compute_the_e4m3_products_and_gradients_close_to_exact(kernels, monkeypatch):
    """Under FP8 experts the frozen products are e4m3 rows times e4m3 expert weights (power-of-two scales): the
    output equals float64 of those quantized operands (each routed row and the activation quantized per row, W per
    output row), LoRA's terms on the unquantized rows; the gradients (dy's rows in e4m3 times Wᵀ's) stay within
    FP8's error of the exact float64 ones, and the Pallas kernel computes what the jnp reference does."""
    from jaxtune.ops import dispatch
    from pallas_kernels.fp8_quantize import quantize_blocks, quantize_rows_reference
    from pallas_kernels.grouped_fp8_matmul import fp8_expert_weights

    rng = np.random.default_rng(5)
    tokens, top_k, experts, hidden, inter = 24, 2, 6, 64, 96
    chosen = np.stack([rng.choice(experts - 1, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    x = rng.standard_normal((tokens, hidden))
    weights = rng.uniform(0.1, 1.0, (tokens, top_k))
    shapes = ((inter, hidden), (inter, hidden), (hidden, inter))
    params = [_projection(rng, experts, o, i, True, False) for o, i in shapes]
    dout = rng.standard_normal((tokens, hidden))
    layout = tile_layout(jnp.asarray(chosen), experts, block_m=16)
    scales = (2.0, 0.5, 1.5)
    factors = tuple((jnp.asarray(p["lora_a"], jnp.float32), jnp.asarray(p["lora_b"], jnp.float32)) for p in params)

    def run(fp8):
        spec = ExpertMLPSpec(top_k, layout.rows, layout.block_m, "swiglu", scales=scales, fp8=fp8)

        def ours(x, weights, lora_factors):
            projections = tuple(ExpertProjection(
                fp8_expert_weights(jnp.asarray(p["weight"], jnp.float32)) if fp8 else jnp.asarray(p["weight"],
                                                                                                  jnp.float32),
                None, *f) for p, f in zip(params, lora_factors))
            return expert_mlp(x, weights, layout, projections, spec)

        with jax.default_matmul_precision("highest"):
            y, vjp = jax.vjp(ours, jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), factors)
            return y, vjp(jnp.asarray(dout, jnp.float32))

    monkeypatch.setattr(dispatch, "_mode", kernels)
    y, grads = run(dispatch.interpret() and "pallas-interpret" or "xla")
    y_exact, grads_exact = run(None)

    def q_rows(v):  # [n, in] float64 -> the e4m3 values times their row scales, float64
        q, s = quantize_rows_reference(jnp.asarray(v, jnp.float32))
        return np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)

    def q_weight(w):  # [E, out, in] per output row
        q, s = quantize_blocks(jnp.asarray(w, jnp.float32), None, "e4m3")
        return np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)

    def proj(v, p, scale, e):  # v [N, k, in]: the frozen product on quantized operands, LoRA on v
        n, k, width = v.shape
        frozen = np.einsum("nki,nkoi->nko", q_rows(v.reshape(-1, width)).reshape(n, k, width), q_weight(
            p["weight"])[e])
        lora = np.einsum("nkr,nkor->nko", np.einsum("nki,nkri->nkr", v, p["lora_a"][e]), p["lora_b"][e])
        return frozen + scale * lora

    v = np.broadcast_to(x[:, None, :], (tokens, top_k, hidden))
    gate, up = proj(v, params[0], scales[0], chosen), proj(v, params[1], scales[1], chosen)
    h = gate / (1 + np.exp(-gate)) * up
    want = np.einsum("nko,nk->no", proj(h, params[2], scales[2], chosen), weights)
    # float32 intermediates (gate, up, h) between the products: agreement to float32's rounding, amplified by e4m3
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=0, atol=2e-3 * np.abs(want).max())
    assert np.abs(np.asarray(y) - np.asarray(y_exact)).max() < 0.1 * np.abs(np.asarray(y_exact)).max()
    for got, exact in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_exact)):
        got, exact = np.asarray(got, np.float64), np.asarray(exact, np.float64)
        assert np.linalg.norm(got - exact) < 0.1 * np.linalg.norm(exact), (got.shape, np.linalg.norm(got - exact))


def test_a_model_under_compute_fp8_runs_its_experts_in_fp8_where_switched_on(tmp_path, monkeypatch):
    """A 4-bit Qwen3-MoE under compute "fp8": with FP8 experts on, its expert GEMMs take e4m3 operands (forward and
    input gradient) and the LoRA gradients move from compute "bf16"'s by about what the dense
    projections' FP8 moves them; off (the default), no expert GEMM is FP8."""
    from transformers import Qwen3MoeConfig

    from jaxtune.ops import dispatch
    import pallas_kernels.grouped_fp8_matmul as grouped_fp8
    from conftest import set_random_lora

    traced = []  # the FP8 expert products each traced step makes
    product = grouped_fp8.grouped_fp8_product
    monkeypatch.setattr(grouped_fp8, "grouped_fp8_product", lambda *a: traced.append(a[7]) or product(*a))  # impl
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    build_hf_model(config, tmp_path)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 32)))
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="bfloat16", load_in_4bit=True)
    jaxtune.get_peft_model(model, r=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    set_random_lora(model, seed=1)
    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)

    def grads(compute: str, fp8_experts: bool):
        monkeypatch.setattr(dispatch, "MOE_FP8_EXPERTS", fp8_experts)

        def loss(p):
            m = nnx.merge(graphdef, p, rest)
            m.compute = compute
            return jnp.mean(m(ids).astype(jnp.float32) ** 2)

        traced.clear()
        out = jax.grad(loss)(lora)
        return out, list(traced)

    fp8, fp8_kernels = grads("fp8", True)
    plain, plain_kernels = grads("bf16", False)
    off, off_kernels = grads("fp8", False)
    # the experts' products in FP8 (by the jnp reference on this CPU) only where switched on
    assert len(fp8_kernels) >= 6 and set(fp8_kernels) == {"xla"} and off_kernels == plain_kernels == []
    for a, b, c in zip(jax.tree.leaves(fp8), jax.tree.leaves(off), jax.tree.leaves(plain)):
        a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
        # FP8 experts add an error of the size the dense projections' FP8 already makes (~20% on this tiny model)
        assert np.linalg.norm(a - c) <= 1.5 * np.linalg.norm(b - c), a.shape

