"""Logits of jaxtune models equal transformers' (torch, fp32) on tiny random checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import jaxtune
from conftest import build_hf_model

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16, "rope_theta": 500000.0,
}

CONFIGS = {
    "llama-gqa2": lambda: LlamaConfig(**COMMON, num_key_value_heads=2),
    "llama-mqa-tied": lambda: LlamaConfig(**COMMON, num_key_value_heads=1, tie_word_embeddings=True),
    "llama3-rope-scaling": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
    "llama-head-dim-32": lambda: LlamaConfig(**COMMON, num_key_value_heads=2, head_dim=32),
    "llama-linear-rope-bias": lambda: LlamaConfig(
        **COMMON, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    "mistral": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None),
    "mistral-sliding-window": lambda: MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=8),
    "qwen2-bias-tied": lambda: Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-untied-kv1": lambda: Qwen2Config(**COMMON, num_key_value_heads=1, tie_word_embeddings=False),
    # Qwen3: q/k RMSNorm per head before RoPE, no q/k/v bias, explicit head_dim, large rope_theta
    "qwen3-tied": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                      rope_theta=1000000.0),
    "qwen3-untied-kv1": lambda: Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False),
    # YaRN as Qwen3 sets it for long context (factor 4 over an original context shorter than the rows here)
    "qwen3-yarn": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0}),
    "qwen3-head-dim-32": lambda: Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
}


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    hf_model = build_hf_model(CONFIGS[name](), tmp_path)
    model, tokenizer = jaxtune.from_pretrained(tmp_path, dtype="float32")
    assert tokenizer is None
    ids = np.random.default_rng(1).integers(0, 128, size=(2, 24))
    ours = np.asarray(model(ids))
    ref = _hf_logits(hf_model, ids)
    assert ours.shape == ref.shape
    np.testing.assert_array_less(np.abs(ours - ref).max(), 1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    hf_model = build_hf_model(CONFIGS["llama-gqa2"](), tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    ids = np.random.default_rng(2).integers(0, 128, size=(1, 16))
    np.testing.assert_array_less(np.abs(np.asarray(model(ids)) - _hf_logits(hf_model, ids)).max(), 1e-4)


@pytest.mark.parametrize("name", ["llama-gqa2", "qwen2-bias-tied", "qwen3-head-dim-32"])
def test_packed_segments_equal_separate_sequences(name, tmp_path):
    """Each packed segment's logits equal transformers' logits for that sequence alone."""
    hf_model = build_hf_model(CONFIGS[name](), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    rng = np.random.default_rng(3)
    lengths = [7, 1, 12, 4]
    seqs = [rng.integers(0, 128, size=n) for n in lengths]
    packed = np.concatenate(seqs)[None]
    segment_ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])[None]
    ours = np.asarray(model(packed, segment_ids=segment_ids))[0]
    start = 0
    for seq in seqs:
        ref = _hf_logits(hf_model, seq[None])[0]
        np.testing.assert_array_less(np.abs(ours[start:start + len(seq)] - ref).max(), 1e-4)
        start += len(seq)


def test_bf16_logits_close_to_transformers_bf16(tmp_path):
    hf_model = build_hf_model(CONFIGS["llama-gqa2"](), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path)  # default dtype bfloat16
    assert model.embed_tokens.weight[...].dtype == np.dtype("bfloat16")
    ids = np.random.default_rng(4).integers(0, 128, size=(2, 16))
    ref = _hf_logits(hf_model, ids)  # fp32 reference: bf16 rounding of weights and activations only
    ours = np.asarray(model(ids))
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel < 2e-2, rel
