"""Bad input gets one clear line naming the problem and the fix; the CLI exits non-zero."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from transformers import LlamaConfig

import jaxtune
from conftest import build_hf_model
from jaxtune.cli import main as cli_main

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg and msg
    return msg


def test_missing_path(tmp_path):
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.from_pretrained(tmp_path / "nope")
    assert "does not exist" in _one_line(e.value) and "nope" in str(e.value)


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    with pytest.raises(jaxtune.UnsupportedModelError) as e:
        jaxtune.from_pretrained(tmp_path)
    msg = _one_line(e.value)
    assert "'gpt2'" in msg and "llama, mistral, qwen2, qwen3" in msg


def test_a_moe_family_with_shared_experts_is_an_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "hidden_size": 64}))
    with pytest.raises(jaxtune.UnsupportedModelError, match="qwen2_moe.*qwen3_moe, mixtral"):
        jaxtune.from_pretrained(tmp_path)


def test_truncated_safetensors(tmp_path):
    build_hf_model(LlamaConfig(**TINY), tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.from_pretrained(tmp_path)
    assert "truncated or corrupt" in _one_line(e.value) and "model.safetensors" in str(e.value)


def test_missing_shard(tmp_path):
    build_hf_model(LlamaConfig(**TINY), tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / victim)
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.from_pretrained(tmp_path)
    assert victim in _one_line(e.value) and "missing" in str(e.value)


def test_tensor_missing_from_checkpoint(tmp_path):
    from safetensors.numpy import load_file, save_file

    build_hf_model(LlamaConfig(**TINY), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.from_pretrained(tmp_path)
    assert "model.layers.1.mlp.up_proj.weight" in _one_line(e.value)


def test_shape_mismatch_with_config(tmp_path):
    build_hf_model(LlamaConfig(**TINY), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.from_pretrained(tmp_path)
    assert "shape" in _one_line(e.value) and "config.json" in str(e.value)


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(jaxtune.UnsupportedModelError) as e:
        jaxtune.from_pretrained(path)
    assert "'gpt2'" in _one_line(e.value) and "supported: llama" in str(e.value)


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 7)
    with pytest.raises(jaxtune.CheckpointError) as e:
        jaxtune.from_pretrained(path)
    assert "broken.gguf" in _one_line(e.value)


def test_unsupported_rope_type():
    with pytest.raises(jaxtune.UnsupportedModelError) as e:
        jaxtune.ModelConfig.from_hf({**LlamaConfig(**TINY).to_dict(), "rope_scaling": {"rope_type": "longrope"}})
    assert "longrope" in _one_line(e.value)
    with pytest.raises(jaxtune.UnsupportedModelError) as e:  # YaRN without its original context
        jaxtune.ModelConfig.from_hf({**LlamaConfig(**TINY).to_dict(), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert "original_max_position_embeddings" in _one_line(e.value)


def test_cli_reports_one_line_and_exits_nonzero(tmp_path, capsys):
    code = cli_main(["generate", str(tmp_path / "missing-model"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("jaxtune: error: ") and err.count("\n") == 1 and "does not exist" in err
