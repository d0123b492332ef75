"""Qwen3.5 (hybrid Gated DeltaNet + gated attention): logits against transformers in float32 on rows longer than one
chunk, from the text-only and the published multimodal layout (vision tower and MTP head skipped with a note);
packed rows equal each sample alone; NF4 QLoRA on every projection trains; what is not built yet is refused in one
line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import Qwen3_5TextConfig

import jaxtune
from conftest import build_hf_model
from jaxtune.errors import UnsupportedModelError

SHAPES = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8)


def _logits(model, ids, **kw) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return np.asarray(model(jnp.asarray(ids), **kw))


def _assert_close(got, want, tol=1e-4):
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max()), np.abs(got - want).max()


def _multimodal_layout(text_dir, out_dir):
    """The published layout: the language model under model.language_model, a vision tower and an MTP head beside
    it, the text settings under text_config."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(text_dir / "model.safetensors")
    renamed = {("lm_head.weight" if k == "lm_head.weight" else "model.language_model." + k[len("model."):]): v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((8, 3, 2, 2, 2), np.float32)
    renamed["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    out_dir.mkdir()
    save_file(renamed, out_dir / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((text_dir / "config.json").read_text())
    (out_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "architectures": [
        "Qwen3_5ForConditionalGeneration"], "text_config": text, "tie_word_embeddings": False}))


@pytest.mark.parametrize("layout", ["text", "multimodal"])
def test_logits_equal_transformers_over_several_chunks(tmp_path, layout):
    hf = build_hf_model(Qwen3_5TextConfig(**SHAPES), tmp_path / "text")
    path = tmp_path / "text"
    if layout == "multimodal":
        _multimodal_layout(tmp_path / "text", tmp_path / "mm")
        path = tmp_path / "mm"
        with pytest.warns(UserWarning, match="skipped 2 tensors of the checkpoint's mtp and visual"):
            model, _ = jaxtune.from_pretrained(path, dtype="float32")
    else:
        model, _ = jaxtune.from_pretrained(path, dtype="float32")
    cfg = model.config
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) and cfg.partial_rotary_factor == 0.25
    assert model.gated_deltanet_layers.linear_attn.conv1d.weight.shape == (3, 96, 1, 4)  # 2 x 2 x 16 + 4 x 8
    ids = np.random.default_rng(0).integers(0, 128, (2, 150))  # 150 tokens: three chunks of 64, the last ragged
    with torch.no_grad():
        want = hf(torch.as_tensor(ids)).logits.numpy()
    _assert_close(_logits(model, ids), want)


@pytest.mark.parametrize("kernels", ["xla", "pallas-interpret"])
def test_packed_rows_give_each_sample_its_own_logits(tmp_path, kernels, monkeypatch):
    """Two samples packed in one row: the convolution's window and the recurrent state restart at the second, so
    its logits are those of the sample alone (transformers on it), and so are the first's. Under the Pallas modes
    the linear layers run the chunked kernel (pallas_kernels/gated_delta.py; head dims of 16)."""
    from jaxtune.ops import dispatch

    monkeypatch.setattr(dispatch, "_mode", kernels)
    hf = build_hf_model(Qwen3_5TextConfig(**{**SHAPES, "linear_value_head_dim": 16}), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 128, 70), rng.integers(0, 128, 50)
    row = np.concatenate([a, b])[None]
    segments = np.concatenate([np.ones(70, np.int32), np.full(50, 2, np.int32)])[None]
    got = _logits(model, row, segment_ids=jnp.asarray(segments))
    with torch.no_grad():
        for sample, part in ((a, got[0, :70]), (b, got[0, 70:])):
            _assert_close(part, hf(torch.as_tensor(sample[None])).logits.numpy()[0])


def test_a_4bit_run_adapts_every_projection_and_trains(tmp_path, tiny_tokenizer):
    """NF4 codes for the Gated DeltaNet projections too, LoRA on them (`in_proj_qkv`, ..., `out_proj`) beside
    attention's and the MLP's; the loss falls and every adapter moves."""
    build_hf_model(Qwen3_5TextConfig(**{**SHAPES, "vocab_size": len(tiny_tokenizer)}), tmp_path / "base")
    model, tok = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    linear = model.gated_deltanet_layers.linear_attn
    assert type(linear.in_proj_qkv).__name__ == "NF4Linear"
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    targets = ("q_proj", "o_proj", "gate_proj", "down_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj")
    cfg = jaxtune.TrainConfig(format="text", seq_len=96, micro_batch_size=4, max_steps=6, learning_rate=1e-2,
                              warmup_steps=0, lora_r=4, save_steps=0, target_modules=targets)
    result = jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False)
    assert result.losses[-1] < result.losses[0] - 0.1, result.losses
    for proj in (linear.in_proj_qkv, linear.in_proj_a, linear.out_proj, model.layers.self_attn.q_proj,
                 model.gated_deltanet_layers.mlp.down_proj):
        assert np.abs(np.asarray(proj.lora_b[...])).max() > 0



def test_a_grpo_run_samples_through_the_recurrent_state(tmp_path, tiny_tokenizer):
    """GRPO on Qwen3.5: its rollouts decode through the Gated DeltaNet layers' cache, and every step logs finite
    losses over completions of real length."""
    build_hf_model(Qwen3_5TextConfig(**{**SHAPES, "vocab_size": len(tiny_tokenizer)}), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    records = []

    def reward(completions, **kwargs):
        return [float(sum(len(w) <= 3 for w in c.split())) / max(1, len(c.split())) for c in completions]

    cfg = jaxtune.TrainConfig(objective="grpo", format="text", seq_len=48, max_completion_length=8, max_steps=4,
                              num_generations=4, micro_batch_size=4, learning_rate=2e-2, lora_r=4, save_steps=0)
    jaxtune.train(model, tiny_tokenizer, [{"prompt": f"say {i}"} for i in range(8)], cfg, progress=False,
                  reward_funcs=[reward], callback=records.append)
    assert len(records) == 4 and all(np.isfinite(r["loss"]) for r in records)
    assert all(r["completions/mean_length"] > 0 for r in records)


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_generation_equals_transformers(tmp_path, moe, monkeypatch):
    """Prompts of different lengths (left padding): the prefill runs the chunked rule from an empty state and
    leaves each layer's conv window and recurrent state, the steps run the one-token recurrence; with the stacked
    caches and with one per layer, the tokens transformers' greedy `generate` picks."""
    from transformers import Qwen3_5MoeTextConfig

    from conftest import assert_greedy_tokens_are_transformers

    config = Qwen3_5MoeTextConfig(**MOE_SHAPES) if moe else Qwen3_5TextConfig(**SHAPES)
    hf = build_hf_model(config, tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    prompts = [[int(i) for i in np.random.default_rng(5).integers(0, 128, 70)], [7, 8]]  # one longer than a chunk
    assert_greedy_tokens_are_transformers(model, hf, prompts, monkeypatch)


def test_peft_and_merged_exports_load_in_transformers_with_jaxtunes_logits(tmp_path):
    """Adapters on every projection (the Gated DeltaNet ones included): peft on transformers, and the merged
    checkpoint (written in the text-only layout), give jaxtune's logits; the adapter reads back into jaxtune."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from conftest import set_random_lora
    from jaxtune.qlora import ALL_TARGETS

    build_hf_model(Qwen3_5TextConfig(**SHAPES), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1, target_modules=ALL_TARGETS)
    set_random_lora(model, seed=2)
    ids = np.random.default_rng(3).integers(0, 128, (2, 80))
    ours = _logits(model, ids)
    jaxtune.save_peft(model, tmp_path / "peft")
    jaxtune.save_merged(model, tmp_path / "merged", dtype="float32")
    assert "in_proj_qkv" in json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["target_modules"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        _assert_close(ours, peft_model(torch.as_tensor(ids)).logits.numpy())
        _assert_close(ours, merged(torch.as_tensor(ids)).logits.numpy())
        with peft_model.disable_adapter():
            assert np.abs(peft_model(torch.as_tensor(ids)).logits.numpy() - ours).max() > 1e-2
    fresh, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.load_peft(fresh, tmp_path / "peft")
    _assert_close(_logits(fresh, ids), ours, tol=1e-5)


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "full_attention"]}, "layer_types"),
    ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
])
def test_configs_that_name_no_model_are_refused_in_one_line(tmp_path, change, words):
    build_hf_model(Qwen3_5TextConfig(**SHAPES), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=words) as e:
        jaxtune.from_pretrained(tmp_path)
    assert "\n" not in str(e.value)


MOE_SHAPES = {**{k: v for k, v in SHAPES.items() if k != "intermediate_size"}, "moe_intermediate_size": 64,
              "shared_expert_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}


def test_the_moe_variants_logits_equal_transformers(tmp_path):
    """Qwen3.5-MoE: every layer (linear and full attention alike) routes to its top-k experts, renormalized, and
    adds its shared expert scaled by sigmoid(shared_expert_gate)."""
    from transformers import Qwen3_5MoeTextConfig

    hf = build_hf_model(Qwen3_5MoeTextConfig(**MOE_SHAPES), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert model.config.shared_expert_intermediate_size == 64 and model.config.norm_topk_prob
    assert model.gated_deltanet_layers.mlp.shared_expert.up_proj.weight.shape == (3, 64, 64)
    ids = np.random.default_rng(0).integers(0, 128, (2, 100))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids)).logits.numpy()
    _assert_close(_logits(model, ids), want)


def test_a_4bit_moe_run_trains_the_routed_and_shared_experts(tmp_path, tiny_tokenizer):
    from transformers import Qwen3_5MoeTextConfig

    build_hf_model(Qwen3_5MoeTextConfig(**{**MOE_SHAPES, "vocab_size": len(tiny_tokenizer)}), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    shared = model.layers.mlp.shared_expert
    assert type(shared.gate_proj).__name__ == "NF4Linear" and type(model.layers.mlp.gate_proj).__name__ == "NF4Experts"
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=96, micro_batch_size=4, max_steps=6, learning_rate=1e-2,
                              warmup_steps=0, lora_r=4, save_steps=0)
    result = jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False)
    assert result.losses[-1] < result.losses[0] - 0.1, result.losses
    for proj in (shared.down_proj, model.gated_deltanet_layers.mlp.shared_expert.up_proj,
                 model.gated_deltanet_layers.mlp.down_proj):
        assert np.abs(np.asarray(proj.lora_b[...])).max() > 0
    # merged onto the original weights, the routed and the shared experts' adapters in: transformers' logits are
    # those of jaxtune's adapters on the unquantized base
    from flax import nnx
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "base", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    reference, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.get_peft_model(reference, r=4)
    nnx.update(reference, nnx.state(model, nnx.LoRAParam))
    ids = np.random.default_rng(4).integers(0, len(tiny_tokenizer), (1, 40))
    with torch.no_grad():
        got = merged(torch.as_tensor(ids)).logits.numpy()
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        assert np.abs(base(torch.as_tensor(ids)).logits.numpy() - got).max() > 1e-2  # the adapters are in it
    want = _logits(reference, ids)
    _assert_close(got, want)
    # PEFT: the shared expert's adapters on its own modules, the routed experts' on the fused parameters, both
    # run by peft + transformers to the same logits and read back into jaxtune by their module paths
    jaxtune.save_peft(model, tmp_path / "peft", base_model_name_or_path=str(tmp_path / "base"))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                         tmp_path / "peft").eval()
        _assert_close(peft(torch.as_tensor(ids)).logits.numpy(), want)
    back, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.load_peft(back, tmp_path / "peft")
    _assert_close(_logits(back, ids), want)


def test_a_tiny_hybrid_model_trains_through_the_cli(tmp_path, tiny_tokenizer):
    """`jaxtune train` on a Qwen3.5 directory at 4 bits, LoRA on the Gated DeltaNet projections too (a --config
    file names them): the logged loss falls, and `jaxtune export --peft` writes the adapter."""
    from jaxtune.cli import main

    build_hf_model(Qwen3_5TextConfig(**{**SHAPES, "vocab_size": len(tiny_tokenizer)}), tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    rows = [{"prompt": f"hello {i}", "completion": f" world {i} " * 3} for i in range(32)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "c.yaml").write_text("target_modules: [q_proj, o_proj, gate_proj, up_proj, down_proj, in_proj_qkv, "
                                     "in_proj_z, out_proj]\n")
    assert main(["train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--format",
                 "completion", "--out", str(tmp_path / "run"), "--max-steps", "8", "--seq-len", "64", "--batch-size",
                 "4", "--lora-r", "4", "--lr", "0.02", "--dtype", "float32", "--config", str(tmp_path / "c.yaml")]) == 0
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    assert main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "peft")]) == 0
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {"in_proj_qkv", "out_proj", "q_proj"} <= set(config["target_modules"])


def test_selective_remat_recomputes_no_linear_layer_projection_or_rule_forward(tmp_path, monkeypatch):
    """Under remat "selective" the Gated DeltaNet layer keeps its input projections' outputs and the gated delta
    rule's output: its backward runs the qkv projection and the kernel's output pass once (as with no remat),
    where "per-layer" remat runs both again."""
    from jaxtune.ops import dispatch
    from test_kernel_dispatch import live_calls, live_eqns

    monkeypatch.setattr(dispatch, "_mode", "pallas-interpret")
    shapes = {**SHAPES, "vocab_size": 160, "linear_value_head_dim": 16}
    build_hf_model(Qwen3_5TextConfig(**shapes), tmp_path)
    qkv_width = 2 * shapes["linear_num_key_heads"] * shapes["linear_key_head_dim"] + \
        shapes["linear_num_value_heads"] * shapes["linear_value_head_dim"]
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 160, (1, 70)))
    counts = {}
    for policy in ("none", "selective", "full"):
        model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
        jaxtune.get_peft_model(model, r=4)
        model.remat_policy = policy
        graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(ids))))(lora).jaxpr
        qkv_dots = live_eqns(jaxpr, lambda e: e.primitive.name == "dot_general"
                             and e.outvars[0].aval.shape[-1] == qkv_width)
        counts[policy] = (qkv_dots, live_calls(jaxpr, "gated_delta_output"))
    assert counts["selective"] == counts["none"]
    assert counts["full"][0] > counts["none"][0] and counts["full"][1] > counts["none"][1]
