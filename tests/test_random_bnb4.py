"""benchmarks/tools/make_bnb4_checkpoint.py writes a random checkpoint in bitsandbytes' 4-bit layout without a
full-precision copy (how a 70B is made on a 64 GB disk): bitsandbytes reads back the same weights jaxtune
loads, and transformers on bnb's dequantization gives jaxtune's logits."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxtune
from conftest import benchmark_script


def _script():
    return benchmark_script("make_bnb4_checkpoint")


def test_a_random_bnb4_checkpoint_reads_the_same_in_bitsandbytes_transformers_and_jaxtune(tmp_path):
    import torch
    from bitsandbytes import functional as F
    from bitsandbytes.functional import QuantState
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "ckpt"
    info = _script().write_checkpoint("tiny", str(out), progress=False)
    assert info["path"] == str(out) and not (tmp_path / "ckpt.partial").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(out / shard))
    assert set(tensors) == set(index["weight_map"])

    model, tokenizer = jaxtune.from_pretrained(out, dtype="float32")  # its quantization_config: NF4 as stored
    assert tokenizer is not None and tokenizer("w5 w7")["input_ids"] == [5, 7]
    config = AutoConfig.from_pretrained(out)
    del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if f"{name}.absmax" in tensors:  # bitsandbytes' own reading of the 4-bit bytes
                parts = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
                state = QuantState.from_dict(parts, device=torch.device("cpu"))
                state.dtype = torch.float32
                weight = F.dequantize_4bit(tensors[name], state)
                assert 0.01 < float(weight.std()) < 0.03  # N(0, 0.02), as trained Llama weights
                param.copy_(weight)
            else:
                param.copy_(tensors[name].float())
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 12))
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(model(ids))
    assert np.isfinite(got).all()
    np.testing.assert_array_less(np.abs(got - ref).max(), 1e-4)
    assert AutoTokenizer.from_pretrained(out).eos_token == "</s>"


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_the_bf16_form_holds_the_draws_the_4bit_form_quantizes(tmp_path, name):
    """`--bf16` writes the same random weights unquantized (the HF checkpoint a conversion benchmark starts from):
    quantized by jaxtune as bitsandbytes would, they are the bnb-4bit form's bytes (a mixture of experts' too, one
    tensor per expert as the hub lays them out)."""
    script = _script()
    script.write_checkpoint(name, str(tmp_path / "bnb"), progress=False)
    info = script.write_checkpoint(name, str(tmp_path / "bf16"), progress=False, bf16=True)
    assert info["format"] == "bf16"
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    from_bnb, _ = jaxtune.from_pretrained(tmp_path / "bnb")
    quantized, _ = jaxtune.from_pretrained(tmp_path / "bf16", load_in_4bit=True)
    import jax

    a, b = jax.tree_util.tree_leaves_with_path(from_bnb), jax.tree_util.tree_leaves_with_path(quantized)
    assert len(a) == len(b) > 10
    for (path, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_a_truncated_bf16_mixture_of_experts_reads_the_same_in_transformers_and_jaxtune(tmp_path):
    """`--layers` keeps a model's shapes with fewer layers (a Qwen3-30B-A3B-shaped benchmark checkpoint that fits
    the disk); the experts in the hub's per-expert layout give transformers' logits."""
    import torch
    from transformers import AutoModelForCausalLM

    info = _script().write_checkpoint("tiny-moe", str(tmp_path / "moe"), progress=False, bf16=True, layers=1)
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["num_hidden_layers"] == 1
    assert info["format"] == "bf16"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32)
    model, _ = jaxtune.from_pretrained(tmp_path / "moe", dtype="float32", load_in_4bit=False)
    assert model.config.num_experts == 8 and model.config.num_layers == 1
    ids = np.random.default_rng(0).integers(0, 512, size=(2, 12))
    with torch.no_grad():
        ref = hf(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(ids)), ref, atol=1e-4)
