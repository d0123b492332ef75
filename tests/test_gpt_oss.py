"""gpt-oss (attention sinks, alternating sliding / full layers, YaRN RoPE, biased router and experts with the clamped
SwiGLU, the hub's fused expert tensors): logits against transformers in float32 on rows longer than the window,
packed rows, NF4 QLoRA training, greedy generation; what is not built yet is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, GptOssConfig

import jaxtune
from conftest import build_hf_model

SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)


def _hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def _close(got, want, tol=1e-4):
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max()), np.abs(got - want).max()


def test_logits_equal_transformers_beyond_the_window(tmp_path):
    hf = build_hf_model(GptOssConfig(**SHAPES), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    cfg = model.config
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.rope_type == "yarn"
    ids = np.random.default_rng(0).integers(0, 128, (2, 30))
    _close(np.asarray(model(ids)), _hf_logits(hf, ids))


@pytest.mark.parametrize("kernels", ["xla", "pallas-interpret"])
def test_packed_rows_give_each_sample_its_own_logits(tmp_path, kernels, monkeypatch):
    """Two samples packed in one row, each longer than the window, get the logits each has alone in transformers;
    under the Pallas modes (heads of 64) attention runs the flash kernel with the sinks."""
    import jax

    from jaxtune.ops import dispatch

    monkeypatch.setattr(dispatch, "_mode", kernels)
    hf = build_hf_model(GptOssConfig(**{**SHAPES, "head_dim": 64}), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 128, 20), rng.integers(0, 128, 13)
    row = np.concatenate([a, b])[None]
    seg = np.concatenate([np.ones(20, np.int32), np.full(13, 2, np.int32)])[None]
    with jax.default_matmul_precision("highest"):
        got = np.asarray(model(row, segment_ids=seg))[0]
    assert ("flash_attention_fwd" in str(jax.make_jaxpr(lambda r: model(r, segment_ids=seg))(row))) == (
        kernels == "pallas-interpret")
    _close(got[:20], _hf_logits(hf, a[None])[0])
    _close(got[20:], _hf_logits(hf, b[None])[0])


def test_greedy_generation_equals_transformers(tmp_path, monkeypatch):
    """Left-padded prompts, one longer than the window: the KV cache's sliding layers attend through the window
    and every layer's sinks join the softmax, as transformers' greedy `generate` does."""
    from conftest import assert_greedy_tokens_are_transformers

    hf = build_hf_model(GptOssConfig(**SHAPES), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    prompts = [[int(i) for i in np.random.default_rng(5).integers(0, 128, 13)], [7, 8]]
    assert_greedy_tokens_are_transformers(model, hf, prompts, monkeypatch, max_new_tokens=10)


def test_a_4bit_run_trains_the_experts_and_refuses_exports_it_cannot_write(tmp_path, tiny_tokenizer):
    """NF4 experts (each quantized on its own from the fused tensors) with LoRA on every expert and attention
    projection train with falling loss; merged export writes the hub's fused layout; GGUF export refuses in one
    line, before writing."""
    build_hf_model(GptOssConfig(**{**SHAPES, "vocab_size": len(tiny_tokenizer)}), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    assert type(model.layers.mlp.gate_proj).__name__ == "NF4Experts" and model.layers.mlp.gate_proj.bias is not None
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(16)]
    cfg = jaxtune.TrainConfig(format="text", seq_len=64, micro_batch_size=4, max_steps=6, learning_rate=1e-2,
                              warmup_steps=0, lora_r=4, save_steps=0)
    result = jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False)
    assert result.losses[-1] < result.losses[0] - 0.1, result.losses
    for proj in (model.layers.mlp.down_proj, model.sliding_attention_layers.mlp.gate_proj,
                 model.sliding_attention_layers.self_attn.q_proj):
        assert np.abs(np.asarray(proj.lora_b[...])).max() > 0
    # GGUF (tests/test_gguf_export.py: llama.cpp's logits) in one type for every matrix; llama-quantize's mixes not
    with pytest.raises(jaxtune.CheckpointError, match="a gpt-oss GGUF is written as bf16, f16, q8_0, f32, not q4_k_m"):
        jaxtune.save_gguf(model, tmp_path / "out" / "m.gguf", tokenizer=tiny_tokenizer, gguf_type="q4_k_m")
    assert not (tmp_path / "out" / "m.gguf").exists()
    # merged onto the original bf16 weights: the hub's fused layout, which transformers reads to jaxtune's logits
    jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "base", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = np.random.default_rng(4).integers(0, len(tiny_tokenizer), (1, 20))
    reference, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.get_peft_model(reference, r=4)
    nnx.update(reference, nnx.state(model, nnx.LoRAParam))  # the trained adapters on the unquantized base
    _close(_hf_logits(merged, ids), np.asarray(reference(ids)))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    assert np.abs(_hf_logits(base, ids) - _hf_logits(merged, ids)).max() > 1e-2  # the adapters are in it


def _write_mxfp4_experts(model_dir, seed: int = 0) -> None:
    """Rewrites a saved gpt-oss checkpoint as the published one stores it: each fused expert tensor as random
    MXFP4 `*_blocks` / `*_scales` (weights of about 0.03), and quantization_config saying so."""
    import json

    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(seed)
    tensors = load_file(model_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        tensors[name + "_blocks"] = rng.integers(0, 256, (experts, outputs, inputs // 32, 16), dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(120, 124, (experts, outputs, inputs // 32), dtype=np.uint8)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("shape", [(1, 8, 1), (3, 10, 2), (4, 64, 5)])
def test_mxfp4_dequantizes_as_transformers(shape):
    """Every code and exponent (random bytes, scales across the E8M0 range short of overflow): jaxtune's MXFP4
    reading equals transformers' own dequantization bit for bit, in the hub's [E, in, out] layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from convert.mxfp4_source import Mxfp4Source

    experts, outputs, groups = shape
    rng = np.random.default_rng(sum(shape))
    blocks = rng.integers(0, 256, (experts, outputs, groups, 16), dtype=np.uint8)
    scales = rng.integers(2, 250, (experts, outputs, groups), dtype=np.uint8)

    class Pair:
        def names(self):
            return ["w_blocks", "w_scales"]

        def shape(self, name):
            return (blocks if name == "w_blocks" else scales).shape

        def get(self, name):
            return blocks if name == "w_blocks" else scales

    source = Mxfp4Source(Pair())
    assert source.names() == ["w"] and source.shape("w") == (experts, groups * 32, outputs)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(np.asarray(source.get("w"), np.float32), want.numpy())


def test_mxfp4_checkpoints_load_with_transformers_logits(tmp_path):
    """The published layout (MXFP4 experts): transformers reads the files itself; jaxtune dequantizes them at load
    to the same logits in float32, quantizes each expert to the NF4 bytes bitsandbytes makes of it, and `convert`
    writes the NF4 checkpoint a direct 4-bit load makes."""
    from flax import nnx

    build_hf_model(GptOssConfig(**SHAPES), tmp_path / "hf")
    _write_mxfp4_experts(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model, _ = jaxtune.from_pretrained(tmp_path / "hf", dtype="float32")
    ids = np.random.default_rng(2).integers(0, 128, (2, 24))
    want = _hf_logits(hf, ids)
    _close(np.asarray(model(ids)), want)
    # merged export onto the MXFP4 base: the hub's bf16 layout, which transformers reads to jaxtune's logits
    from conftest import set_random_lora

    jaxtune.get_peft_model(model, r=4)
    set_random_lora(model, seed=3)
    jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "hf", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    _close(_hf_logits(merged, ids), np.asarray(model(ids)))
    # 4-bit: each expert's NF4 bytes are bitsandbytes' quantization of transformers' dequantized weight
    from bitsandbytes import functional as F

    quantized, _ = jaxtune.from_pretrained(tmp_path / "hf", dtype="float32", load_in_4bit=True)
    gate_up = hf.model.layers[3].mlp.experts.gate_up_proj.detach()[2]  # layer 3 (a full layer: the `layers` stack)
    for proj, weight in (("gate_proj", gate_up[:, 0::2].T), ("up_proj", gate_up[:, 1::2].T)):
        codes, _ = F.quantize_4bit(weight.contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4")
        ours = np.asarray(getattr(quantized.layers.mlp, proj).codes[...][1, 2])
        np.testing.assert_array_equal(ours.reshape(-1), codes.numpy().reshape(-1))
    jaxtune.convert(tmp_path / "hf", tmp_path / "nf4", quantize="nf4")
    converted, _ = jaxtune.from_pretrained(tmp_path / "nf4")
    direct, _ = jaxtune.from_pretrained(tmp_path / "hf", load_in_4bit=True)
    arrays = lambda m: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m))}  # noqa: E731
    a, b = arrays(converted), arrays(direct)
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def test_mxfp4_refusals_are_one_line(tmp_path):
    """MXFP4 on a family jaxtune reads no MXFP4 tensors of, and a blocks tensor without its scales."""
    import json

    from safetensors.numpy import load_file, save_file

    build_hf_model(GptOssConfig(**SHAPES), tmp_path)
    _write_mxfp4_experts(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(jaxtune.CheckpointError, match="down_proj_blocks has no .*down_proj_scales beside it") as e:
        jaxtune.from_pretrained(tmp_path)
    assert "\n" not in str(e.value)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "qwen3_moe"
    with pytest.raises(jaxtune.UnsupportedModelError, match="qwen3_moe checkpoints quantized with mxfp4 are not read"):
        jaxtune.models.config.ModelConfig.from_hf(config)


def test_converted_checkpoint_reloads_as_loaded(tmp_path):
    """`jaxtune convert` to the pre-quantized format: the NF4 experts split from the fused tensors, their biases,
    the router's and the sinks read back array for array as a direct 4-bit load makes them."""
    from flax import nnx

    build_hf_model(GptOssConfig(**SHAPES), tmp_path / "hf")
    jaxtune.convert(tmp_path / "hf", tmp_path / "nf4", quantize="nf4")
    converted, _ = jaxtune.from_pretrained(tmp_path / "nf4")
    direct, _ = jaxtune.from_pretrained(tmp_path / "hf", load_in_4bit=True)
    assert converted.config == direct.config
    arrays = lambda m: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(m))}  # noqa: E731
    a, b = arrays(converted), arrays(direct)
    assert a.keys() == b.keys() and any("sinks" in p for p in a) and any("bias" in p and "mlp" in p for p in a)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))


def test_peft_adapters_load_in_peft_with_jaxtunes_logits(tmp_path):
    """LoRA on attention and every expert: PEFT's adapter on the fused `gate_up_proj` (gate and up in alternate
    columns, one adapter of rank 2r) and `down_proj` of both kinds of layers; peft on transformers gives jaxtune's
    logits, and the adapter reads back into jaxtune."""
    from peft import PeftModel

    from conftest import set_random_lora

    build_hf_model(GptOssConfig(**SHAPES), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.get_peft_model(model, r=4, lora_alpha=8, seed=1)
    set_random_lora(model, seed=2)
    ids = np.random.default_rng(3).integers(0, 128, (2, 24))
    ours = np.asarray(model(ids))
    jaxtune.save_peft(model, tmp_path / "peft")
    import json

    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
    _close(_hf_logits(peft_model, ids), ours)
    with peft_model.disable_adapter():
        assert np.abs(_hf_logits(peft_model, ids) - ours).max() > 1e-2
    fresh, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.load_peft(fresh, tmp_path / "peft")
    _close(np.asarray(fresh(ids)), ours, tol=1e-5)
