"""The real bundled model (SmolLM2-135M-Instruct, GGUF): generation equals transformers' from the same file."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxtune
from jaxtune.generate import encode_prompt, eos_token_ids, generate_tokens
from jaxtune.models.causal_lm import KVCache

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a primary color."}],
]


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return jaxtune.from_pretrained(smollm2_path, dtype="float32")


@pytest.fixture(scope="module")
def short_smol(short_smollm2_path):
    """The bundled model cut to 2 layers: what the cache and the sampler do does not depend on the depth."""
    return jaxtune.from_pretrained(short_smollm2_path, dtype="float32")


@pytest.fixture(scope="module")
def hf_smol(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path), dtype=torch.float32
    ).eval()


def test_config_read_from_gguf(smol):
    cfg = smol[0].config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and smol[0].lm_head is None


def test_logits_match_transformers_gguf(smol, hf_smol):
    model, tokenizer = smol
    ids = np.asarray([encode_prompt(tokenizer, PROMPTS[0])])
    with torch.no_grad():
        ref = hf_smol(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_array_less(np.abs(np.asarray(model(ids)) - ref).max(), 1e-3)


def test_greedy_generation_equals_transformers(smol, hf_smol):
    model, tokenizer = smol
    ours = jaxtune.generate(model, tokenizer, PROMPTS, max_new_tokens=16)  # batched, different lengths
    for prompt, text in zip(PROMPTS, ours):
        ids = torch.as_tensor([encode_prompt(tokenizer, prompt)])
        with torch.no_grad():
            out = hf_smol.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
        ref = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text == ref
    assert "Paris" in ours[0]


def test_kv_cache_decode_equals_full_forward(short_smol):
    model, tokenizer = short_smol
    prompt = encode_prompt(tokenizer, PROMPTS[1])
    continuation = generate_tokens(model, [prompt], max_new_tokens=12, eos_ids=eos_token_ids(model, tokenizer))[0]
    full = np.asarray([prompt + continuation])
    want = np.asarray(model(full))[0]
    n = len(prompt)
    cache = KVCache.empty(model.config, 1, 64, model.dtype)
    seg = jnp.ones((1, n), jnp.int32)
    logits, cache = model.forward_with_cache(jnp.asarray(full[:, :n]), jnp.arange(n)[None], seg, cache, jnp.int32(0))
    got = [np.asarray(logits)[0]]
    # a prefill's last_only logits are the full prefill's last row, its cache the same
    last, last_cache = model.forward_with_cache(jnp.asarray(full[:, :n]), jnp.arange(n)[None], seg,
                                                KVCache.empty(model.config, 1, 64, model.dtype), jnp.int32(0),
                                                last_only=True)
    assert last.shape == (1, 1, logits.shape[-1])
    np.testing.assert_allclose(np.asarray(last)[0, -1], got[0][-1], rtol=0, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(last_cache.k), np.asarray(cache.k))
    for i in range(n, full.shape[1]):
        step, cache = model.forward_with_cache(
            jnp.asarray(full[:, i:i + 1]), jnp.asarray([[i]]), jnp.ones((1, 1), jnp.int32), cache, jnp.int32(i)
        )
        got.append(np.asarray(step)[0])
    got = np.concatenate(got)
    np.testing.assert_array_less(np.abs(got - want).max(), 1e-3)


def test_sampling_is_seeded(short_smol):
    model, tokenizer = short_smol
    a = jaxtune.generate(model, tokenizer, PROMPTS[1], max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    b = jaxtune.generate(model, tokenizer, PROMPTS[1], max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    assert a == b and len(a) == 1
