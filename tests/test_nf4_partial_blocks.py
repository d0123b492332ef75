"""Projections whose rows are not whole 64-weight blocks (an expert width of 48, a dense MLP of 48) load, train and
read back at 4 bits: such a weight stays 16-bit with a one-line warning, the others are NF4 as bitsandbytes makes
them; a bitsandbytes 4-bit checkpoint's blocks that run across rows are read as bitsandbytes dequantizes them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, Qwen3MoeConfig

import jaxtune
from conftest import build_hf_model

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _bnb_roundtrip(w: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' own NF4 (double-quantized) quantize then dequantize of a weight."""
    from bitsandbytes import functional as F

    q, state = F.quantize_4bit(w.float().contiguous(), blocksize=64, quant_type="nf4", compress_statistics=True)
    return F.dequantize_4bit(q, state, blocksize=64, quant_type="nf4")


def test_a_dense_mlp_of_48_keeps_down_proj_16bit_and_matches_transformers(tmp_path, tiny_tokenizer):
    hf = build_hf_model(LlamaConfig(vocab_size=len(tiny_tokenizer), intermediate_size=48, **SMALL), tmp_path / "m")
    with pytest.warns(UserWarning, match=r"down_proj \(48 inputs\) kept in float32, not NF4"):
        model, _ = jaxtune.from_pretrained(tmp_path / "m", dtype="float32", load_in_4bit=True)
    from jaxtune.models.causal_lm import Linear
    from jaxtune.qlora import NF4Linear

    assert isinstance(model.layers.mlp.down_proj, Linear) and isinstance(model.layers.mlp.up_proj, NF4Linear)
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.down_proj.weight[...][1]),
                                  hf.model.layers[1].mlp.down_proj.weight.detach().numpy())
    with torch.no_grad():  # transformers with every other projection through bitsandbytes' NF4
        for layer in hf.model.layers:
            for proj in (*(getattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")),
                         layer.mlp.gate_proj, layer.mlp.up_proj):
                proj.weight.copy_(_bnb_roundtrip(proj.weight))
        ids = np.random.default_rng(0).integers(0, len(tiny_tokenizer), (2, 12))
        want = hf(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), want, atol=2e-4)


def test_a_mixture_of_experts_of_width_48_trains_at_4bits(tmp_path, tiny_tokenizer):
    """The issue's case: Qwen3-MoE with moe_intermediate_size=48 through `jaxtune train` at 4 bits."""
    from jaxtune.cli import main

    build_hf_model(Qwen3MoeConfig(vocab_size=len(tiny_tokenizer), intermediate_size=96, moe_intermediate_size=48,
                                  num_experts=4, num_experts_per_tok=2, head_dim=16, **SMALL), tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    rows = [{"prompt": f"hello {i}", "completion": f" world {i}"} for i in range(16)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.warns(UserWarning, match=r"down_proj \(48 inputs\) kept in"):
        assert main(["train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "d.jsonl"), "--format",
                     "completion", "--out", str(tmp_path / "run"), "--max-steps", "2", "--seq-len", "32",
                     "--batch-size", "2", "--lora-r", "4", "--dtype", "float32"]) == 0
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_a_bnb_4bit_checkpoint_with_blocks_across_rows_reads_as_bitsandbytes_dequantizes(tmp_path, tiny_tokenizer):
    """bitsandbytes' blocks of 64 over the flattened weight, read as its reference dequantization computes them
    (`_dequantize_4bit_compute`, what its CUDA kernel does; its CPU kernel reads such a weight by rows)."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.functional import dequantize_blockwise

    build_hf_model(LlamaConfig(vocab_size=len(tiny_tokenizer), intermediate_size=48, **SMALL), tmp_path / "m")
    bnb = AutoModelForCausalLM.from_pretrained(
        tmp_path / "m", device_map="cpu", quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32))
    bnb.save_pretrained(tmp_path / "bnb")
    tiny_tokenizer.save_pretrained(tmp_path / "bnb")
    with pytest.warns(UserWarning, match="down_proj"):
        model, _ = jaxtune.from_pretrained(tmp_path / "bnb", dtype="float32")
    for i, layer in enumerate(bnb.model.layers):
        weight = layer.mlp.down_proj.weight
        state = weight.quant_state
        absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
        want = _dequantize_4bit_compute(weight.data.view(torch.uint8).reshape(-1), absmax, state.code, 64,
                                        tuple(state.shape), torch.float32).numpy()
        np.testing.assert_array_equal(np.asarray(model.layers.mlp.down_proj.weight[...][i]), want)


def test_the_merged_nf4_export_writes_such_a_weight_as_bitsandbytes_quantizes_it(tmp_path, tiny_tokenizer):
    from bitsandbytes import functional as F
    from safetensors.numpy import load_file

    hf = build_hf_model(LlamaConfig(vocab_size=len(tiny_tokenizer), intermediate_size=48, **SMALL), tmp_path / "m")
    with pytest.warns(UserWarning, match="down_proj"):
        model, tok = jaxtune.from_pretrained(tmp_path / "m", dtype="float32", load_in_4bit=True)
    jaxtune.save_merged(model, tmp_path / "nf4", base=tmp_path / "m", tokenizer=tok, dtype="nf4")
    saved = {}
    for shard in (tmp_path / "nf4").glob("*.safetensors"):
        saved.update(load_file(shard))
    w = hf.model.layers[1].mlp.down_proj.weight.detach().float()
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    np.testing.assert_array_equal(saved["model.layers.1.mlp.down_proj.weight"].reshape(-1), q.numpy().reshape(-1))
    np.testing.assert_array_equal(saved["model.layers.1.mlp.down_proj.weight.absmax"], state.absmax.numpy())
    with pytest.warns(UserWarning, match="down_proj"):  # and it reads back in jaxtune: the NF4 ones as they were,
        back, _ = jaxtune.from_pretrained(tmp_path / "nf4", dtype="float32")  # down_proj as bnb's 4 bits give it
    np.testing.assert_array_equal(np.asarray(back.layers.mlp.up_proj.codes[...]),
                                  np.asarray(model.layers.mlp.up_proj.codes[...]))
    err = np.abs(np.asarray(back.layers.mlp.down_proj.weight[...][1]) - w.numpy())
    assert 0 < err.max() < 0.2 * np.abs(w.numpy()).max()
