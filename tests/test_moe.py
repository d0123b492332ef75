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
from test_kernel_dispatch import all_eqns
from jaxtune.errors import UnsupportedModelError
from jaxtune.moe.grouped import grouped_matmul
from jaxtune.moe.layout import tile_layout
from jaxtune.moe.routing import route

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


def _jaxtune_and_torch_logits(model, torch_model, ids) -> tuple[np.ndarray, np.ndarray]:
    """jaxtune's logits (float32 matmuls at full precision) and a torch model's, on the same ids."""
    with torch.no_grad():
        want = torch_model(torch.as_tensor(ids)).logits.numpy()
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(jnp.asarray(ids)))
    return got, want


def _assert_same_logits(got: np.ndarray, want: np.ndarray, tol: float = 1e-4) -> None:
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max())

@pytest.mark.parametrize("kernels", ["xla", "pallas-interpret"])
@pytest.mark.parametrize("tokens, top_k, experts, k, n", [(13, 2, 4, 64, 32), (40, 4, 8, 64, 16), (5, 1, 6, 32, 64)])
def test_grouped_matmul_through_the_tile_layout_equals_float64(kernels, tokens, top_k, experts, k, n):
    """Routed rows placed by `tile_layout` (grouped by expert, padded to whole tiles; uneven and empty experts) and
    multiplied by their experts' weights (the dispatch's two implementations), with the LoRA-style gradients."""
    rng = np.random.default_rng(tokens)
    chosen = np.stack([rng.choice(experts - 1, top_k, replace=False) for _ in range(tokens)])  # the last unused
    layout = tile_layout(jnp.asarray(chosen), experts, block_m=16)
    position = np.asarray(layout.position)
    assert len(set(position)) == tokens * top_k and layout.rows % 16 == 0 and np.asarray(layout.group_sizes)[-1] == 0
    groups = np.asarray(layout.tile_group)
    assert all(groups[p // 16] == e for p, e in zip(position, chosen.reshape(-1)))  # each row in its expert's tile
    x = np.zeros((layout.rows, k), np.float32)
    x[position] = rng.standard_normal((tokens * top_k, k))
    w = rng.standard_normal((experts, n, k)).astype(np.float32)
    dy = rng.standard_normal((layout.rows, n)).astype(np.float32)
    jaxtune.set_kernels(kernels)
    try:
        with jax.default_matmul_precision("highest"):
            y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, layout, trainable=True), jnp.asarray(x), jnp.asarray(w))
            dx, dw = vjp(jnp.asarray(dy))
    finally:
        jaxtune.set_kernels(None)
    routed = chosen.reshape(-1)
    want = np.einsum("rk,rnk->rn", x[position].astype(np.float64), w[routed].astype(np.float64))
    np.testing.assert_allclose(np.asarray(y)[position], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx)[position], np.einsum("rn,rnk->rk", dy[position], w[routed]),
                               rtol=1e-5, atol=1e-4)
    want_dw = np.zeros(w.shape)
    np.add.at(want_dw, routed, np.einsum("rn,rk->rnk", dy[position].astype(np.float64), x[position]))
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-4)


def test_routing_takes_each_tokens_top_k_experts_with_renormalized_weights():
    x = jax.random.normal(jax.random.key(0), (10, 16))
    router = jax.random.normal(jax.random.key(1), (6, 16))
    r = route(x, router, 3, normalize=True)
    probs = np.asarray(jax.nn.softmax(np.asarray(x, np.float64) @ np.asarray(router, np.float64).T, axis=-1))
    top = np.argsort(-probs, axis=-1)[:, :3]
    np.testing.assert_array_equal(np.asarray(r.experts), top)
    np.testing.assert_allclose(np.asarray(r.weights), np.take_along_axis(probs, top, -1)
                               / np.take_along_axis(probs, top, -1).sum(-1, keepdims=True), rtol=1e-5)


def test_a_bf16_router_is_one_bf16_gemm_with_float32_logits():
    """bf16 tokens and router: the logits come from one GEMM of the bf16 operands accumulating in float32 (no float32
    copy of the tokens), equal to float64 of the same bf16 values up to float32 rounding; the tokens' gradient
    through the routing weights is the float64 one too."""
    x = jax.random.normal(jax.random.key(0), (40, 64)).astype(jnp.bfloat16)
    router = (0.3 * jax.random.normal(jax.random.key(1), (8, 64))).astype(jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda x: route(x, router, 2, normalize=True).logits)(x))
    assert "dot_general" in jaxpr and "convert_element_type" not in jaxpr.split("dot_general")[0], jaxpr
    r = route(x, router, 2, normalize=True)
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64).T
    np.testing.assert_allclose(np.asarray(r.logits), logits, rtol=1e-6, atol=1e-5)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(r.experts), np.argsort(-probs, axis=-1)[:, :2])
    c = np.random.default_rng(0).standard_normal((40, 2))
    dx = jax.grad(lambda x: jnp.sum(route(x, router, 2, normalize=False).weights * c))(x)
    top = np.argsort(-probs, axis=-1)[:, :2]
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, top, c, -1)
    dlogits = probs * (dprobs - (probs * dprobs).sum(-1, keepdims=True))
    want = dlogits @ np.asarray(router, np.float64)
    np.testing.assert_allclose(np.asarray(dx, np.float64), want, rtol=2e-2, atol=2e-3)  # dx is bf16
    # the backward's products are 16-bit GEMMs too (no float32 operand: that GEMM runs off the tensor cores)
    backward = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(route(x, w, 2, normalize=False).weights * c),
                                       argnums=(0, 1)))(x, router)
    dots = [e for e in all_eqns(backward.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) >= 3 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), backward
    dw = jax.grad(lambda w: jnp.sum(route(x, w, 2, normalize=False).weights * c))(router)
    want_dw = dlogits.T @ np.asarray(x, np.float64)
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_equal_transformers(tmp_path, family):
    hf = build_hf_model(CONFIGS[family](), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert model.config.num_experts == hf.config.num_experts if family != "mixtral" else hf.config.num_local_experts
    ids = np.random.default_rng(0).integers(0, 128, (2, 12))
    _assert_same_logits(*_jaxtune_and_torch_logits(model, hf, ids))


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


@pytest.mark.parametrize("family, kernels", [("qwen3_moe", "xla"), ("mixtral", "xla"), ("qwen3_moe", "pallas-interpret")])
def test_expert_lora_equals_transformers_on_the_merged_weights(tmp_path, family, kernels, monkeypatch):
    """LoRA on attention and on every expert's gate/up/down (one adapter per expert): the logits of
    transformers with W + s * B @ A written into each projection (the NF4 base dequantized); through XLA's
    ragged_dot and through the grouped Pallas kernel."""
    from conftest import set_random_lora

    monkeypatch.setenv("JAXTUNE_KERNELS", kernels)

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


def _merge_into(hf, model) -> None:
    """transformers' projections set to jaxtune's W + s * B @ A (attention and every expert)."""
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            merged = np.asarray(getattr(model.layers.self_attn, name).merged_weight())
            for i, layer in enumerate(hf.model.layers):
                getattr(layer.self_attn, name).weight.copy_(torch.from_numpy(merged[i].copy()))
        mlp = model.layers.block_sparse_moe if hasattr(model.layers, "block_sparse_moe") else model.layers.mlp
        gate, up, down = (np.asarray(getattr(mlp, n).merged_weight()) for n in ("gate_proj", "up_proj", "down_proj"))
        for i, layer in enumerate(hf.model.layers):
            experts = (layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp).experts
            experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([gate[i], up[i]], axis=1).copy()))
            experts.down_proj.copy_(torch.from_numpy(down[i].copy()))


@pytest.mark.parametrize("family, padded", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_the_load_balancing_loss_is_transformers(tmp_path, family, padded):
    """A config with output_router_logits: the SFT loss is transformers' cross-entropy plus router_aux_loss_coef
    times its load_balancing_loss_func (padding excluded, as its attention mask excludes it), and the gradient
    reaching an attention adapter below the routers is torch's through the chain rule (dL/dB = s dL/dW A^T)."""
    from conftest import set_random_lora
    from jaxtune.data.packing import IGNORE
    from jaxtune.training.objectives import SFT
    from jaxtune.training.step import loss_and_grads, split_model

    hf = build_hf_model(CONFIGS[family](output_router_logits=True, router_aux_loss_coef=0.7), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.7
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1)
    set_random_lora(model, seed=2)
    _merge_into(hf, model)
    ids = np.random.default_rng(3).integers(0, 128, (2, 12))
    real = np.ones_like(ids)
    if padded:
        real[1, 8:] = 0  # the second row: 8 tokens, then padding
    labels = np.where(real[:, 1:] > 0, ids[:, 1:], IGNORE)
    batch = {"input_ids": ids, "labels": np.concatenate([labels, np.full((2, 1), IGNORE)], 1),
             "segment_ids": real, "positions": np.broadcast_to(np.arange(12), (2, 12))}
    model.router_aux = True
    graphdef, lora, frozen = split_model(model)
    with jax.default_matmul_precision("highest"):
        loss, grads, metrics = jax.jit(lambda l, f, b: loss_and_grads(graphdef, l, f, b, None, 64, SFT(0.7)))(
            lora, frozen, {k: jnp.asarray(v, jnp.int32)[None] for k, v in batch.items()})
    q = hf.model.layers[0].self_attn.q_proj.weight
    q.requires_grad_(True)
    out = hf(torch.as_tensor(ids), attention_mask=torch.as_tensor(real),
             labels=torch.as_tensor(np.where(real > 0, ids, -100)))
    out.loss.backward()
    assert float(metrics["aux_loss"]) == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert float(loss) == pytest.approx(float(out.loss), rel=1e-5)
    assert 0.7 * float(out.aux_loss) > 0.1 * float(out.loss)  # the term is not negligible
    p = model.layers.self_attn.q_proj
    want = p.scale * q.grad.numpy() @ np.asarray(p.lora_a[...][0]).T
    got = np.asarray(grads["layers"]["self_attn"]["q_proj"]["lora_b"][0])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * np.abs(want).max())


def test_a_run_with_the_load_balancing_loss_logs_it_and_every_layer_loop_computes_it_alike(tmp_path, tiny_tokenizer):
    """train() adds the loss where the config asks for it, logs `aux_loss`, and the layer loop, its unrolled form
    and remat "offload"'s loops give the same first step; DPO refuses it in one line."""
    config = CONFIGS["qwen3_moe"](vocab_size=len(tiny_tokenizer), output_router_logits=True, router_aux_loss_coef=0.5)
    build_hf_model(config, tmp_path / "base")
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    first = {}
    for name, options in {"loop": {}, "unrolled": {"unroll_layers": True}, "offload": {"remat": "offload"}}.items():
        model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
        records = []
        cfg = jaxtune.TrainConfig(format="text", seq_len=48, micro_batch_size=4, max_steps=2, learning_rate=1e-2,
                                  warmup_steps=0, lora_r=4, **{"remat": "selective", **options})
        jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False, callback=records.append)
        assert all(r["aux_loss"] > 0 for r in records), records
        first[name] = (records[0]["loss"], records[0]["aux_loss"])
    assert first["unrolled"] == pytest.approx(first["loop"], rel=1e-5)
    assert first["offload"] == pytest.approx(first["loop"], rel=1e-5)
    with pytest.raises(jaxtune.ConfigError, match="adds to the SFT loss only, not to dpo's") as e:
        jaxtune.train(model, tiny_tokenizer, [{"prompt": "a", "chosen": " b", "rejected": " c"}] * 4,
                      jaxtune.TrainConfig(objective="dpo", format="text", seq_len=16, max_steps=1), progress=False)
    assert "\n" not in str(e.value)


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


def test_remat_auto_recomputes_the_experts_when_keeping_their_rows_does_not_fit(tmp_path, tiny_tokenizer, monkeypatch,
                                                                               capsys):
    """For a mixture of experts remat auto tries "recompute-experts" between "selective" and "per-layer": its plan
    needs less than "selective"'s (the routed rows' gate/up outputs are not kept), and where "selective" does not fit
    it is the choice, said in the run's line, and the run trains."""
    import jaxtune.training.remat_choice as remat_choice

    # many layers of wide experts, as the models this is for: the rows every layer keeps outweigh the one layer's
    # recompute in flight
    build_hf_model(CONFIGS["qwen3_moe"](vocab_size=len(tiny_tokenizer), moe_intermediate_size=512,
                                        num_experts_per_tok=4, num_hidden_layers=8), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    needs = []
    real = remat_choice.step_bytes_or_none

    def planned(*args):  # the real plans; "selective" (the first) told it does not fit
        needs.append(real(*args))
        return None if len(needs) == 1 else needs[-1]

    monkeypatch.setattr(remat_choice, "step_bytes_or_none", planned)
    monkeypatch.setattr(remat_choice, "memory_stats", lambda: {"bytes_limit": 2**40})
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(8)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=48, micro_batch_size=4, max_steps=3, learning_rate=1e-2,
                              warmup_steps=0, lora_r=4, save_steps=0)
    result = jaxtune.train(model, tiny_tokenizer, rows, cfg, out_dir=tmp_path / "run", progress=False)
    said = [line for line in capsys.readouterr().out.splitlines() if "remat auto" in line]
    assert result.remat == "recompute-experts" and len(needs) == 2, (said, needs)
    assert needs[1] < needs[0], needs  # the experts' rows are the step's largest saved activations here
    assert "selective needs more; recompute-experts needs" in said[0] and "recompute-experts fits" in said[0], said
    assert all(np.isfinite(result.losses))


@pytest.mark.parametrize("change, words", [
    ({"num_experts_per_tok": 9}, "1 <= num_experts_per_tok <= num_experts"),
])
def test_unsupported_routing_options_are_refused_in_one_line_before_loading(tmp_path, change, words):
    build_hf_model(CONFIGS["qwen3_moe"](), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=words) as e:
        jaxtune.from_pretrained(tmp_path)
    assert "\n" not in str(e.value)


EXPERT_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("family, rslora, targets", [("qwen3_moe", False, EXPERT_TARGETS),
                                                     ("mixtral", True, EXPERT_TARGETS),
                                                     ("qwen3_moe", False, ["q_proj", "down_proj"]),
                                                     ("mixtral", False, ["up_proj"])])
def test_expert_adapters_export_to_peft_on_transformers_fused_experts(tmp_path, family, rslora, targets):
    """save_peft writes the per-expert adapters on transformers' fused expert parameters (PEFT's
    target_parameters): peft loads them onto the HF model and gives jaxtune's logits (float32 base)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from conftest import set_random_lora

    build_hf_model(CONFIGS[family](), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=False)
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, use_rslora=rslora, seed=1, target_modules=targets)
    set_random_lora(model, seed=2)
    jaxtune.save_peft(model, tmp_path / "peft")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    ids = np.random.default_rng(3).integers(0, 128, (2, 12))
    got, want = _jaxtune_and_torch_logits(model, peft_model, ids)
    _assert_same_logits(got, want)
    with peft_model.disable_adapter(), torch.no_grad():  # the adapters changed the logits (they were loaded)
        plain = peft_model(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(plain - want).max() > 1e-2
    # and back: a fresh model with the adapter read from the directory gives the same logits
    fresh, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=False)
    jaxtune.load_peft(fresh, tmp_path / "peft")
    _assert_same_logits(_jaxtune_and_torch_logits(fresh, peft_model, ids)[0], got, tol=1e-5)


def test_a_peft_trained_expert_adapter_loads_with_peft_s_logits(tmp_path):
    """An adapter PEFT made itself (random, gate_up_proj's factors not block-diagonal, its own ranks and alphas per
    parameter, attention too) loads into jaxtune with the logits peft gives on transformers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    build_hf_model(CONFIGS["qwen3_moe"](), tmp_path / "base")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], init_lora_weights=False,
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                        rank_pattern={"down_proj": 2}, alpha_pattern={"gate_up_proj": 3})
    peft_model = get_peft_model(hf, config).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    ids = np.random.default_rng(3).integers(0, 128, (2, 12))
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=False)
    jaxtune.load_peft(model, tmp_path / "peft")
    got, want = _jaxtune_and_torch_logits(model, peft_model, ids)
    _assert_same_logits(got, want)
    with peft_model.disable_adapter(), torch.no_grad():  # the adapter changes the logits
        assert np.abs(peft_model(torch.as_tensor(ids)).logits.numpy() - want).max() > 1e-2


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_merged_moe_checkpoint_loads_in_transformers_with_the_adapters_logits(tmp_path, family):
    """save_merged writes W + s * B @ A per expert in the hub layout (`mlp.experts.E.gate_proj`, Mixtral's
    `block_sparse_moe.experts.E.w1`), onto the original weights (`base`) or the dequantized NF4 ones:
    transformers loads it to the logits of the model with the same adapters on that base."""
    from transformers import AutoModelForCausalLM

    from conftest import set_random_lora

    build_hf_model(CONFIGS[family](), tmp_path / "base")
    ids = np.random.default_rng(3).integers(0, 128, (2, 12))
    logits = {}
    for name, in_4bit in (("float", False), ("nf4", True)):
        model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=in_4bit)
        jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1)
        set_random_lora(model, seed=2)
        with jax.default_matmul_precision("highest"):
            logits[name] = np.asarray(model(jnp.asarray(ids)))
        if in_4bit:
            jaxtune.save_merged(model, tmp_path / "onto-original", base=tmp_path / "base", dtype="float32")
            with pytest.warns(UserWarning, match="dequantized NF4"):
                jaxtune.save_merged(model, tmp_path / "onto-nf4", dtype="float32")
    for out, want in (("onto-original", logits["float"]), ("onto-nf4", logits["nf4"])):
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype=torch.float32).eval()
        with torch.no_grad():
            got = hf(torch.as_tensor(ids)).logits.numpy()
        assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max()), out
    assert np.abs(logits["float"] - logits["nf4"]).max() > 1e-3  # the two bases differ: each merge kept its own


@pytest.mark.parametrize("family, args, words", [
    ("qwen3_moe-unnormalized", ["--peft", "{out}/peft", "--gguf", "{out}/m.gguf"], "norm_topk_prob=false"),
    ("mixtral", ["--merged", "{out}/merged", "--dtype", "nf4"], "mixture-of-experts")])
def test_the_cli_refuses_a_moe_export_it_cannot_write_before_loading_anything(tmp_path, capsys, monkeypatch, family,
                                                                              args, words):
    from jaxtune.cli import main

    build_hf_model(CONFIGS[family](), tmp_path / "base")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"base_model": str(tmp_path / "base"), "train": {}}))
    loaded = []
    monkeypatch.setattr("convert.export.load_run", lambda *a, **k: loaded.append(a))
    (tmp_path / "out").mkdir()
    capsys.readouterr()  # what building the checkpoint printed
    assert main(["export", str(tmp_path / "run"), *(a.format(out=tmp_path / "out") for a in args)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxtune: error:") and words in err[0], err
    assert not loaded and not list((tmp_path / "out").iterdir())


def test_exports_a_moe_model_cannot_write_yet_are_refused_in_one_line(tmp_path):
    """An NF4 merged MoE checkpoint; a GGUF of top-k weights llama.cpp would renormalize."""
    build_hf_model(CONFIGS["qwen3_moe-unnormalized"](), tmp_path / "base")
    model, tok = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(model, r=4)
    for export, words in ((lambda: jaxtune.save_merged(model, tmp_path / "merged", dtype="nf4"), "mixture-of-experts"),
                          (lambda: jaxtune.save_gguf(model, tmp_path / "m.gguf", tokenizer=tok),
                           "norm_topk_prob=false; export --merged instead")):
        with pytest.raises(UnsupportedModelError, match=words) as e:
            export()
        assert "\n" not in str(e.value)
    assert not list(tmp_path.glob("merged*")) + list(tmp_path.glob("m.gguf"))


def test_a_converted_moe_checkpoint_loads_the_same_nf4_experts(tmp_path):
    """`jaxtune convert` writes each expert's NF4 arrays at its (layer, expert) slot of the stacks; loading the
    result gives the model `from_pretrained(load_in_4bit=True)` builds from the HF checkpoint."""
    build_hf_model(CONFIGS["qwen3_moe"](), tmp_path / "hf")
    jaxtune.convert(tmp_path / "hf", tmp_path / "nf4", quantize="nf4", dtype="float32")
    direct, _ = jaxtune.from_pretrained(tmp_path / "hf", dtype="float32", load_in_4bit=True)
    converted, _ = jaxtune.from_pretrained(tmp_path / "nf4", dtype="float32")
    for name in ("gate_proj", "up_proj", "down_proj"):
        a, b = getattr(direct.layers.mlp, name), getattr(converted.layers.mlp, name)
        np.testing.assert_array_equal(np.asarray(a.codes[...]), np.asarray(b.codes[...]))
        np.testing.assert_array_equal(np.asarray(a.absmax_codes[...]), np.asarray(b.absmax_codes[...]))
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 128, (1, 10)))
    np.testing.assert_array_equal(np.asarray(direct(ids)), np.asarray(converted(ids)))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_greedy_generation_equals_transformers(tmp_path, family, monkeypatch):
    """Batched prompts of different lengths (left padding, KV cache, stacked or one per layer as GRPO's rollouts
    decode on a GPU): the tokens transformers' greedy `generate` picks."""
    from conftest import assert_greedy_tokens_are_transformers

    hf = build_hf_model(CONFIGS[family](), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert_greedy_tokens_are_transformers(model, hf, [[5, 9, 17, 33], [7, 8]], monkeypatch, max_new_tokens=10)
