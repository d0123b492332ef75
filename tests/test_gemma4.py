"""Gemma 4, dense (sliding and full layers with their own head size, KV heads and proportional RoPE, keys as values,
q/k/v norms, unscaled logits, four norms and a scalar per layer, GeGLU, scaled embeddings, soft-capped logits):
logits against transformers in float32 on rows longer than the window, packed rows, the published multimodal layout,
greedy generation, NF4 QLoRA training, PEFT and merged export read by transformers; what is not built yet is refused
in one line."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma4TextConfig

import jaxtune
from conftest import build_hf_model, set_random_lora

LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)
SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, layer_types=LAYERS,
              hidden_size_per_layer_input=0, final_logit_softcapping=30.0)


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _close(got, want, tol=1e-4):
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max()), np.abs(got - want).max()


def _build(tmp_path, **overrides):
    hf = build_hf_model(Gemma4TextConfig(**{**SHAPES, **overrides}), tmp_path)
    with torch.no_grad():  # layer scalars away from 1 (a trained model's are)
        for i, layer in enumerate(hf.model.layers):
            layer.layer_scalar.fill_(0.5 + 0.25 * i)
    hf.save_pretrained(tmp_path)
    return hf


def _train_4bit(path, tiny_tokenizer, trained: tuple[str, ...]):
    """The NF4 model at `path` after 6 QLoRA steps on short text rows: the loss falls, and every projection named
    (stack.module.projection) has learned a non-zero LoRA B."""
    model, _ = jaxtune.from_pretrained(path, dtype="float32", load_in_4bit=True)
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=64, micro_batch_size=4, max_steps=6, learning_rate=1e-2,
                              warmup_steps=0, lora_r=4, save_steps=0)
    result = jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False)
    assert result.losses[-1] < result.losses[0] - 0.1, result.losses
    for name in trained:
        proj = functools.reduce(getattr, name.split("."), model)
        assert np.abs(np.asarray(proj.lora_b[...])).max() > 0, name
    return model


def _exports_run_in_transformers(base, out, vocab: int):
    """Random adapters on the unquantized model at `base`: the PEFT adapter in peft + transformers, the merged
    checkpoint in transformers, and the adapter read back into jaxtune give jaxtune's logits; returns the last."""
    from peft import PeftModel

    reference, _ = jaxtune.from_pretrained(base, dtype="float32")
    jaxtune.get_peft_model(reference, r=4)
    set_random_lora(reference, seed=2)
    ids = np.random.default_rng(4).integers(0, vocab, (1, 20))
    want = np.asarray(reference(ids))
    jaxtune.save_peft(reference, out / "adapter", base_model_name_or_path=str(base))
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    _close(_hf_logits(PeftModel.from_pretrained(hf, out / "adapter").eval(), ids), want)
    jaxtune.save_merged(reference, out / "merged", base=base, dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    _close(_hf_logits(merged, ids), want)
    back, _ = jaxtune.from_pretrained(base, dtype="float32")
    jaxtune.load_peft(back, out / "adapter")
    _close(np.asarray(back(ids)), want)
    return back


@pytest.mark.parametrize("k_eq_v", [False, True])
def test_logits_equal_transformers_beyond_the_window(tmp_path, k_eq_v):
    """Both kinds of layers, each with its own geometry and RoPE; with attention_k_eq_v the full layers' keys serve
    as values and have their own KV heads (no v_proj)."""
    extra = dict(attention_k_eq_v=True, num_global_key_value_heads=1) if k_eq_v else {}
    hf = _build(tmp_path, **extra)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    cfg = model.config
    assert (cfg.full_head_dim, cfg.full_k_eq_v, cfg.full_num_kv_heads) == (32, k_eq_v, 1 if k_eq_v else 0)
    assert (model.layers.self_attn.v_proj is None) == k_eq_v and model.sliding_attention_layers.self_attn.v_proj
    ids = np.random.default_rng(0).integers(0, 128, (2, 30))
    _close(np.asarray(model(ids)), _hf_logits(hf, ids))


def test_packed_rows_give_each_sample_its_own_logits(tmp_path):
    hf = _build(tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 128, 20), rng.integers(0, 128, 13)
    row = np.concatenate([a, b])[None]
    seg = np.concatenate([np.ones(20, np.int32), np.full(13, 2, np.int32)])[None]
    got = np.asarray(model(row, segment_ids=seg))[0]
    _close(got[:20], _hf_logits(hf, a[None])[0])
    _close(got[20:], _hf_logits(hf, b[None])[0])


def test_the_published_multimodal_layout_loads_its_language_model(tmp_path):
    """`gemma4` (text settings under text_config, `model.language_model.*`, the towers beside): the language model
    loads to the text model's logits and the towers are skipped with a note."""
    from safetensors.numpy import load_file, save_file

    hf = _build(tmp_path / "text")
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(tmp_path / "text" / "model.safetensors").items()}
    tensors["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = np.zeros((4, 4), np.float32)
    tensors["model.embed_vision.embedding_projection.weight"] = np.zeros((4, 4), np.float32)
    (tmp_path / "mm").mkdir()
    save_file(tensors, tmp_path / "mm" / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((tmp_path / "text" / "config.json").read_text())
    (tmp_path / "mm" / "config.json").write_text(json.dumps({
        "model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "gemma4_vision"}, "tie_word_embeddings": True}))
    with pytest.warns(UserWarning, match="skipped 2 tensors of the checkpoint's embed_vision and vision_tower"):
        model, _ = jaxtune.from_pretrained(tmp_path / "mm", dtype="float32")
    ids = np.random.default_rng(2).integers(0, 128, (1, 20))
    _close(np.asarray(model(ids)), _hf_logits(hf, ids))


def test_a_4bit_run_trains_and_exports_to_transformers(tmp_path, tiny_tokenizer):
    """NF4 QLoRA with LoRA on every projection of both kinds of layers trains with falling loss (soft-capped
    logits in the loss); the PEFT adapter runs in peft + transformers, and the merged checkpoint in transformers, to
    the logits of jaxtune's adapters on the unquantized base."""
    from flax import nnx
    from peft import PeftModel

    _build(tmp_path / "base", vocab_size=len(tiny_tokenizer), attention_k_eq_v=True, num_global_key_value_heads=1)
    _train_4bit(tmp_path / "base", tiny_tokenizer, ("layers.self_attn.k_proj",
                                                   "sliding_attention_layers.self_attn.v_proj", "layers.mlp.down_proj"))
    _exports_run_in_transformers(tmp_path / "base", tmp_path, len(tiny_tokenizer))


SMALL = dict(num_hidden_layers=6, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
             num_kv_shared_layers=2, use_double_wide_mlp=True,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                          "sliding_attention", "full_attention"])


def test_small_model_logits_equal_transformers(tmp_path):
    """E2B / E4B's layout: per-layer inputs (their own embedding table and a projection of the embeddings, through
    each layer's gate and projection), the last two layers attending to the keys and values of the last earlier
    layer of their type, with MLPs twice as wide; the layers run one by one."""
    hf = _build(tmp_path, **SMALL)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    cfg = model.config
    assert (cfg.per_layer_dim, cfg.num_kv_shared_layers, cfg.double_wide_mlp) == (8, 2, True)
    assert model.kv_shared_full_layers.self_attn.k_proj is None
    assert model.kv_shared_sliding_layers.mlp.up_proj.weight.shape == (1, 192, 64)
    ids = np.random.default_rng(6).integers(0, 128, (2, 30))
    _close(np.asarray(model(ids)), _hf_logits(hf, ids))


def test_small_model_generates_trains_and_exports(tmp_path, monkeypatch, tiny_tokenizer):
    """Greedy tokens equal transformers' (the sharing layers read their source's cache); NF4 QLoRA trains, the
    gradient of the layers that share keys and values reaching the layer that makes them; PEFT and merged exports
    run in transformers to jaxtune's logits."""
    from conftest import assert_greedy_tokens_are_transformers

    hf = _build(tmp_path / "g", **SMALL)
    model, _ = jaxtune.from_pretrained(tmp_path / "g", dtype="float32")
    prompts = [[int(i) for i in np.random.default_rng(5).integers(3, 100, 13)], [7, 8]]
    assert_greedy_tokens_are_transformers(model, hf, prompts, monkeypatch, max_new_tokens=10)
    _build(tmp_path / "t", **{**SMALL, "vocab_size": len(tiny_tokenizer),
                              "vocab_size_per_layer_input": len(tiny_tokenizer)})
    _train_4bit(tmp_path / "t", tiny_tokenizer, ("sliding_attention_layers.self_attn.k_proj",
                                                "kv_shared_full_layers.self_attn.q_proj",
                                                "kv_shared_sliding_layers.mlp.down_proj"))
    _exports_run_in_transformers(tmp_path / "t", tmp_path, len(tiny_tokenizer))


@pytest.mark.parametrize("kernels", ["xla", "pallas-interpret"])
def test_moe_logits_equal_transformers(tmp_path, kernels, monkeypatch):
    """26B-A4B's layout: routed GeGLU experts beside the dense MLP (the hub's fused [E, 2 * width, hidden] experts
    split at load), the scaled router with per-expert scales; under the Pallas modes the experts run the grouped
    kernel."""
    from jaxtune.ops import dispatch

    monkeypatch.setattr(dispatch, "_mode", kernels)
    hf = _build(tmp_path, attention_k_eq_v=True, num_global_key_value_heads=1, **MOE)
    with torch.no_grad():  # router scales away from 1
        for layer in hf.model.layers:
            layer.router.scale.copy_(1.0 + 0.3 * torch.randn_like(layer.router.scale))
            layer.router.per_expert_scale.copy_(1.0 + 0.3 * torch.randn_like(layer.router.per_expert_scale))
    hf.save_pretrained(tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert model.config.num_experts == 4 and model.layers.moe.gate_proj.weight.shape == (2, 4, 32, 64)
    ids = np.random.default_rng(3).integers(0, 128, (2, 24))
    _close(np.asarray(model(ids)), _hf_logits(hf, ids))


def test_moe_4bit_run_trains_the_experts_and_the_dense_mlp(tmp_path, tiny_tokenizer):
    """NF4 experts and the dense MLP train; PEFT and merged exports run in transformers."""
    _build(tmp_path, vocab_size=len(tiny_tokenizer), **MOE)
    model = _train_4bit(tmp_path, tiny_tokenizer, ("layers.moe.gate_proj", "sliding_attention_layers.moe.down_proj",
                                                   "layers.mlp.up_proj"))
    assert type(model.layers.moe.gate_proj.base).__name__ == "NF4Experts"
    # PEFT (the dense MLP's adapters on its modules, the experts' on the fused `experts` parameters) and merged
    # export (the hub's router, fused experts and every norm), both run in transformers; the adapter reads back
    back = _exports_run_in_transformers(tmp_path, tmp_path / "out", len(tiny_tokenizer))
    assert type(back.layers.moe.gate_proj).__name__ == "LoRAExperts"


def test_converted_checkpoint_reloads_as_loaded(tmp_path):
    """`jaxtune convert` of every Gemma 4 part at once (experts, per-layer inputs, KV sharing): the config and every
    array read back as a direct 4-bit load makes them."""
    from flax import nnx

    _build(tmp_path / "hf", **SMALL, **MOE)
    jaxtune.convert(tmp_path / "hf", tmp_path / "nf4", quantize="nf4")
    converted, _ = jaxtune.from_pretrained(tmp_path / "nf4")
    direct, _ = jaxtune.from_pretrained(tmp_path / "hf", load_in_4bit=True)
    assert converted.config == direct.config and direct.config.per_layer_dim and direct.config.num_experts
    arrays = lambda m: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m))}  # noqa: E731
    a, b = arrays(converted), arrays(direct)
    assert a.keys() == b.keys() and any("embed_tokens_per_layer" in p for p in a)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


@pytest.mark.parametrize("change, message", [
    (dict(num_kv_shared_layers=3, layer_types=LAYERS[:2] + ["full_attention"] * 2),
     "num_kv_shared_layers=3 of 4 layers; every sharing layer needs an earlier layer of its type"),
    (dict(use_bidirectional_attention="all"), "not a causal decoder"),
])
def test_variants_not_built_are_refused_in_one_line_before_loading(tmp_path, change, message):
    config = Gemma4TextConfig(**SHAPES).to_dict()
    config.pop("per_layer_config")  # the published configs' global_head_dim instead
    config.update(change, global_head_dim=32)
    with pytest.raises(jaxtune.UnsupportedModelError, match=message) as e:
        jaxtune.models.config.ModelConfig.from_hf(config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("k_eq_v", [False, True])
def test_greedy_generation_equals_transformers(tmp_path, monkeypatch, k_eq_v):
    """Left-padded prompts, one longer than the window: each attention layer decodes on a cache of its own geometry
    (the full layers' wider heads, fewer KV heads where keys serve as values), as transformers' greedy `generate`."""
    from conftest import assert_greedy_tokens_are_transformers

    extra = dict(attention_k_eq_v=True, num_global_key_value_heads=1) if k_eq_v else {}
    hf = _build(tmp_path, **extra)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    prompts = [[int(i) for i in np.random.default_rng(5).integers(3, 128, 13)], [7, 8]]
    assert_greedy_tokens_are_transformers(model, hf, prompts, monkeypatch, max_new_tokens=10)
