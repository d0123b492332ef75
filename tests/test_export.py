"""PEFT adapters and merged HF checkpoints round-trip through peft and transformers (torch, CPU)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

import jaxtune
from conftest import build_hf_model
from jaxtune.qlora import LORA_TARGETS

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
IDS = np.random.default_rng(0).integers(0, 128, size=(2, 10))


def _randomize_lora(model, seed=1):
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(np.asarray(rng.standard_normal(var.get_value().shape) * 0.1, np.float32))
    return model


def _torch_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(IDS)).logits.float().numpy()


def _close(a, b, tol=1e-4):
    np.testing.assert_array_less(np.abs(np.asarray(a) - np.asarray(b)).max(), tol)


@pytest.mark.parametrize("hf_config, r, alpha, rslora, targets", [
    (LlamaConfig(**COMMON), 8, 16, False, LORA_TARGETS),
    (LlamaConfig(**COMMON, tie_word_embeddings=True), 4, 8, True, ("q_proj", "v_proj")),
    (Qwen2Config(**COMMON), 16, 32, False, ("k_proj", "o_proj", "gate_proj")),
    (Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True), 8, 16, False, LORA_TARGETS),
])
def test_save_peft_loads_in_peft_with_equal_logits(tmp_path, hf_config, r, alpha, rslora, targets):
    from peft import PeftModel

    hf_model = build_hf_model(hf_config, tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.get_peft_model(model, r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets)
    _randomize_lora(model)
    jaxtune.save_peft(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == r and sorted(cfg["target_modules"]) == sorted(targets)
    peft_model = PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    _close(model(IDS), _torch_logits(peft_model))


def test_load_peft_reads_a_peft_written_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    hf_model = build_hf_model(LlamaConfig(**COMMON), tmp_path / "base")
    peft_model = get_peft_model(hf_model, LoraConfig(r=6, lora_alpha=12, use_rslora=True,
                                                     target_modules=["q_proj", "down_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    peft_model.save_pretrained(tmp_path / "adapter")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.load_peft(model, tmp_path / "adapter")
    _close(model(IDS), _torch_logits(peft_model.eval()))
    # and the loaded adapter keeps training: its params are the trainable state
    assert len(nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))) == 6


@pytest.mark.parametrize("hf_config", [LlamaConfig(**COMMON), Qwen3Config(**COMMON, head_dim=32)])
def test_merged_onto_original_weights_loads_in_transformers(tmp_path, hf_config):
    build_hf_model(hf_config, tmp_path / "base")
    qmodel, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(qmodel, r=8, lora_alpha=16)
    _randomize_lora(qmodel)
    jaxtune.save_merged(qmodel, tmp_path / "merged", base=tmp_path / "base", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    # the same adapter on the ORIGINAL (dense) weights, in jaxtune
    jaxtune.save_peft(qmodel, tmp_path / "adapter")
    dense, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.load_peft(dense, tmp_path / "adapter")
    _close(dense(IDS), _torch_logits(merged))
    assert (tmp_path / "merged" / "model.safetensors.index.json").exists()


def test_merged_onto_dequantized_nf4_warns_and_matches_the_qlora_model(tmp_path):
    build_hf_model(Qwen2Config(**COMMON, tie_word_embeddings=True), tmp_path / "base")
    qmodel, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(qmodel, r=4, lora_alpha=8, target_modules=("q_proj", "k_proj", "down_proj"))
    _randomize_lora(qmodel)
    with pytest.warns(UserWarning, match="loses quality"):
        jaxtune.save_merged(qmodel, tmp_path / "merged", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    _close(qmodel(IDS), _torch_logits(merged))


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"peft_type": "IA3"}, "peft_type='IA3'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"target_modules": ["q_proj", "c_attn"]}, "c_attn"),
])
def test_unsupported_adapters_are_clear_errors(tmp_path, change, message):
    build_hf_model(LlamaConfig(**COMMON), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    jaxtune.get_peft_model(model, r=4)
    jaxtune.save_peft(model, tmp_path / "adapter")
    cfg_path = tmp_path / "adapter" / "adapter_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **change}))
    fresh, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.load_peft(fresh, tmp_path / "adapter")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_adapter_for_another_shape_is_a_clear_error(tmp_path):
    build_hf_model(LlamaConfig(**{**COMMON, "hidden_size": 32}), tmp_path / "small")
    small, _ = jaxtune.from_pretrained(tmp_path / "small", dtype="float32")
    jaxtune.get_peft_model(small, r=4)
    jaxtune.save_peft(small, tmp_path / "adapter")
    build_hf_model(LlamaConfig(**COMMON), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32")
    with pytest.raises(jaxtune.CheckpointError, match="another model shape"):
        jaxtune.load_peft(model, tmp_path / "adapter")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no partial outputs anywhere


def test_smollm2_after_training_round_trips_through_peft(tmp_path, tuned_smollm2, short_smollm2_path):
    from peft import PeftModel

    model, tokenizer = tuned_smollm2
    jaxtune.save_peft(model, tmp_path / "adapter")
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(short_smollm2_path),
                                              gguf_file=os.path.basename(short_smollm2_path),
                                              dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = np.asarray([tokenizer("The capital of France is")["input_ids"]])
    with torch.no_grad():
        ref = peft_model(torch.as_tensor(ids)).logits.numpy()
    _close(model(ids), ref, tol=1e-4)  # 49k vocab: fp32 CPU accumulation-order differences
    assert np.abs(np.asarray(model.layers.self_attn.q_proj.lora_b[...])).max() > 0


def test_cli_export_run(tmp_path, tiny_tokenizer, capsys):
    from peft import PeftModel
    from transformers import LlamaConfig as LC

    from jaxtune.cli import main

    build_hf_model(LC(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2), tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    rows = [{"prompt": f"hello {i}", "completion": f" world {i}"} for i in range(32)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--format",
                 "completion", "--out", str(tmp_path / "run"), "--max-steps", "3", "--seq-len", "64",
                 "--batch-size", "2", "--lora-r", "4", "--lr", "0.01", "--dtype", "float32"]) == 0
    assert main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "p"), "--merged", str(tmp_path / "mg"),
                 "--dtype", "float32", "--gguf", str(tmp_path / "g" / "tuned.gguf"), "--gguf-type", "f32"]) == 0
    assert capsys.readouterr().out.count("onto " + str(tmp_path / "m")) == 2
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    via_peft = _torch_logits(PeftModel.from_pretrained(base, tmp_path / "p").eval())
    merged = _torch_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "mg", dtype=torch.float32).eval())
    _close(via_peft, merged)
    via_gguf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="tuned.gguf", dtype=torch.float32)
    _close(via_peft, _torch_logits(via_gguf.eval()))
    assert (tmp_path / "mg" / "tokenizer.json").exists()
    assert main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "p")]) == 1  # exists: refused
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), "--peft", str(tmp_path / "p2"), "--gguf", str(tmp_path / "g" / "tuned.gguf")]) == 1
    assert "already exists" in capsys.readouterr().err and not (tmp_path / "p2").exists()  # refused before writing


def test_cli_exports_a_model_without_adapters_to_a_4bit_gguf(tmp_path, tiny_tokenizer, capsys):
    """`jaxtune export --model` writes the base model itself: its q8_0 GGUF reads back in transformers with the
    base's logits (to q8_0's rounding), and its q4_0 file holds what llama.cpp's q4_0 makes of the original weights
    (not of their NF4 copy, which the loader holds)."""
    import gguf
    from transformers import LlamaConfig as LC

    from jaxtune.cli import main
    from jaxtune.quant import quantize_q4_0

    hf = build_hf_model(LC(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    assert main(["export", "--model", str(tmp_path / "m"), "--gguf", str(tmp_path / "g" / "base.gguf"),
                 "--gguf-type", "q8_0"]) == 0
    assert "onto " + str(tmp_path / "m") in capsys.readouterr().out
    via_gguf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="base.gguf", dtype=torch.float32)
    _close(_torch_logits(hf.eval()), _torch_logits(via_gguf.eval()), tol=5e-2)  # as q8_0 in test_gguf_export
    assert main(["export", "--model", str(tmp_path / "m"), "--gguf", str(tmp_path / "q4.gguf"),
                 "--gguf-type", "q4_0"]) == 0
    stored = {t.name: t for t in gguf.GGUFReader(tmp_path / "q4.gguf").tensors}["blk.1.ffn_down.weight"]
    original = hf.model.layers[1].mlp.down_proj.weight.detach().numpy()
    assert stored.data.tobytes() == quantize_q4_0(original).tobytes()
    capsys.readouterr()
    for argv, message in [
        (["export", "--model", str(tmp_path / "m"), "--peft", str(tmp_path / "p")], "--model has none"),
        (["export", str(tmp_path), "--model", str(tmp_path / "m"), "--gguf", str(tmp_path / "x.gguf")], "one of them"),
        (["export", "--gguf", str(tmp_path / "x.gguf")], "one of them"),
        (["export", "--model", str(tmp_path / "nope"), "--gguf", str(tmp_path / "x.gguf")], "nope"),
    ]:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p").exists() and not (tmp_path / "x.gguf").exists()


def test_export_finds_the_original_weights_behind_a_converted_checkpoint(tmp_path, smollm2_path):
    """A run on a jaxtune NF4 checkpoint merges onto the checkpoint it was converted from (here the bundled GGUF)."""
    from convert.export import original_weights

    build_hf_model(LlamaConfig(**COMMON), tmp_path / "hf")
    jaxtune.convert(tmp_path / "hf", tmp_path / "nf4")
    assert original_weights(str(tmp_path / "nf4")) == str(tmp_path / "hf")
    assert original_weights(str(tmp_path / "hf")) == str(tmp_path / "hf")
    jaxtune.convert(tmp_path / "nf4", tmp_path / "nf4-again")  # a conversion of a conversion: no originals
    assert original_weights(str(tmp_path / "nf4-again")) is None
    assert original_weights(smollm2_path) == smollm2_path
    (tmp_path / "hf").rename(tmp_path / "moved")
    assert original_weights(str(tmp_path / "nf4")) is None


def test_merged_in_nf4_loads_in_transformers_with_bitsandbytes_as_in_jaxtune(tmp_path):
    """`dtype="nf4"`: the merged projections re-quantized as a bitsandbytes 4-bit checkpoint. transformers +
    bitsandbytes read it to jaxtune's logits (the same bytes), and those are what bitsandbytes' own NF4
    quantization of the float32 merge gives."""
    import bitsandbytes.functional as F
    from bitsandbytes.nn import Linear4bit

    build_hf_model(LlamaConfig(**COMMON), tmp_path / "base")
    qmodel, tok = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(qmodel, r=8, lora_alpha=16)
    _randomize_lora(qmodel)
    jaxtune.save_merged(qmodel, tmp_path / "nf4", base=tmp_path / "base", dtype="nf4")
    jaxtune.save_merged(qmodel, tmp_path / "f32", base=tmp_path / "base", dtype="float32")
    config = json.loads((tmp_path / "nf4" / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_quant_type"] == "nf4"

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "nf4", dtype=torch.float32).eval()
    layers = [m for m in hf.modules() if isinstance(m, Linear4bit)]
    assert len(layers) == 7 * COMMON["num_hidden_layers"]
    for m in layers:  # compare in float32 (the file asks bf16, as bnb checkpoints do)
        m.compute_dtype = m.weight.quant_state.dtype = torch.float32
        # and through bnb's dequantization on every CPU: on one with AVX512-BF16 its inference path repacks the
        # weights for a fused kernel that computes in bf16 whatever compute_dtype says
        m.support_avx512bf16_for_cpu = False
    for p in hf.parameters():  # the bf16 embedding, norms and head (exact in float32)
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    ours, _ = jaxtune.from_pretrained(tmp_path / "nf4", dtype="float32")
    _close(ours(IDS), _torch_logits(hf), 1e-4)

    # each projection as bitsandbytes quantizes the float32 merge: the same 4-bit codes; the 8-bit absmax codes
    # of a few blocks one apart (bnb's CPU rounding, as tests/test_nf4.py measures)
    from safetensors.numpy import load_file

    stored = {k: v for f in (tmp_path / "nf4").glob("*.safetensors") for k, v in load_file(f).items()}
    merged = {k: v for f in (tmp_path / "f32").glob("*.safetensors") for k, v in load_file(f).items()}
    projections = [k for k in merged if k.rsplit(".", 2)[-2] in LORA_TARGETS]
    assert len(projections) == 7 * COMMON["num_hidden_layers"]
    for name in projections:
        q, state = F.quantize_4bit(torch.from_numpy(merged[name]), blocksize=64, compress_statistics=True,
                                   quant_type="nf4")
        np.testing.assert_array_equal(stored[name], q.numpy(), err_msg=name)
        assert np.abs(stored[f"{name}.absmax"].astype(int) - state.absmax.numpy().astype(int)).max() <= 1, name
    assert np.abs(np.asarray(ours(IDS)) - _torch_logits(AutoModelForCausalLM.from_pretrained(
        tmp_path / "f32", dtype=torch.float32).eval())).max() > 1e-3  # and it is the 4-bit model, not the float one
