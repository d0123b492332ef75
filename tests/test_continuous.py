"""Continuous batching (jaxtune.rl.continuous): fewer slots than completions, each slot refilled as its completion
ends, on a ring KV cache. References: transformers' greedy `generate` on each prompt alone, and a sampler that
recomputes each completion's whole sequence without any cache, one token at a time, with the same keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, MistralConfig

import jaxtune
from conftest import build_hf_model
from jaxtune.generate import cache_length, left_padded, sample_token
from jaxtune.rl.continuous import completion_key, decode_continuous

SHAPES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 64, int(rng.integers(1, 14)))] for _ in range(count)]


def _continuous(model, prompts, *, slots, refill_rows, max_new_tokens, eos_ids=(), temperature=0.0, top_p=1.0,
                top_k=0, seed=0, per_layer=False):
    ids, pad = left_padded(prompts, 0)
    fn = jax.jit(lambda ids, pad, key: decode_continuous(
        model, ids, pad, key, slots=slots, refill_rows=refill_rows, max_new_tokens=max_new_tokens,
        cache_len=cache_length(ids.shape[1], max_new_tokens), temperature=temperature, top_p=top_p, top_k=top_k,
        eos_ids=tuple(eos_ids), per_layer=per_layer))
    with jax.default_matmul_precision("highest"):
        out, steps, prefills = fn(jnp.asarray(ids), jnp.asarray(pad), jax.random.key(seed))
    return [[t for t in row if t >= 0] for row in np.asarray(out).tolist()], int(steps), int(prefills)


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


@pytest.mark.parametrize("family", ["llama", "mistral-window"])
def test_greedy_completions_equal_transformers_per_prompt(tmp_path, family):
    """Nine prompts of 1-13 tokens through three slots, refilled two (or one) at a time: each completion (ended at
    the first of two EOS ids, so lengths vary from one token to the maximum) is what transformers' greedy `generate`
    gives the prompt alone; with a 4-token sliding window the ring's distances decide what a step sees. The loop
    runs fewer steps than static batches of three would."""
    config = (LlamaConfig(**SHAPES) if family == "llama"
              else MistralConfig(**SHAPES, sliding_window=4))
    hf = build_hf_model(config, tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    prompts, max_new = _prompts(9), 12
    with torch.no_grad():
        free = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=max_new, do_sample=False)[0, len(p):].tolist() for p in prompts]
    eos = {free[0][2], free[3][6]}  # two tokens the completions meet at different points
    want = [_until_eos(f, eos) for f in free]
    assert len({len(w) for w in want}) > 2, want
    for per_layer, refill_rows in ((False, 2), (True, 1)):
        got, steps, prefills = _continuous(model, prompts, slots=3, refill_rows=refill_rows, max_new_tokens=max_new,
                                           eos_ids=sorted(eos), per_layer=per_layer)
        assert got == want
    # each slot refilled as soon as it frees (a refill of one prompt at a time): fewer steps than static batches
    static = sum(max(len(w) for w in want[i:i + 3]) for i in range(0, 9, 3))
    assert steps < static and prefills == 9, (steps, static, prefills)  # one prefill per prompt


def test_sampled_completions_equal_an_uncached_sampler_with_the_same_keys(tmp_path):
    """Temperature, top-p and top-k sampling: each completion equals a reference that runs the model on the whole
    sequence so far (no cache, one row) and draws token t of completion n with completion_key(key, n, t): what a
    completion samples does not depend on its slot, its neighbours or when it started."""
    build_hf_model(LlamaConfig(**SHAPES), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    prompts, max_new, key = _prompts(7, seed=3), 10, jax.random.key(11)
    options = dict(temperature=0.9, top_p=0.9, top_k=20)
    eos = {5, 9, 17}
    got, _, _ = _continuous(model, prompts, slots=2, refill_rows=1, max_new_tokens=max_new, eos_ids=sorted(eos),
                            seed=11, **options)
    forward = jax.jit(lambda ids: model(ids)[0, -1])
    want = []
    for n, prompt in enumerate(prompts):
        seq, new = list(prompt), []
        while len(new) < max_new and not (new and new[-1] in eos):
            with jax.default_matmul_precision("highest"):
                logits = forward(jnp.asarray([seq]))
            token = int(sample_token(logits[None], completion_key(key, n, len(new)), **options)[0])
            new.append(token)
            seq.append(token)
        want.append(new)
    assert got == want
    assert any(len(w) < max_new for w in want) and any(len(w) == max_new for w in want)


def test_the_decode_bound_counts_the_weights_and_cache_a_step_reads(tmp_path):
    """A step's bytes: the NF4 codes and scales (or the dequantized copy, 2 bytes a weight in bf16), the other
    weights but not an untied input embedding, the adapters, and the cache as KVCache allocates it; bandwidth by
    device kind, none on a CPU."""
    from types import SimpleNamespace

    from flax import nnx

    from jaxtune.models.cache import KVCache
    from jaxtune.qlora import get_peft_model
    from jaxtune.quant.weights import QuantizedWeight
    from jaxtune.rl import decode_bound

    shapes = {**SHAPES, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}  # whole 64-weight blocks
    build_hf_model(LlamaConfig(**shapes, tie_word_embeddings=False), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="bfloat16", load_in_4bit=True)
    get_peft_model(model, r=4)
    _, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    flat = nnx.to_flat_state(frozen)
    nbytes = lambda v: v.value.size * v.value.dtype.itemsize  # noqa: E731
    codes = sum(v.value.size for p, v in flat if isinstance(v, QuantizedWeight) and p[-1] == "codes")
    quantized = sum(nbytes(v) for _, v in flat if isinstance(v, QuantizedWeight))
    embed = 64 * 64 * 2
    rest = sum(nbytes(v) for _, v in flat) - quantized - embed
    adapters = sum(nbytes(v) for _, v in nnx.to_flat_state(lora))
    assert codes == 2 * (64 * (64 + 32 + 32 + 64) + 3 * 64 * 128) // 2  # two layers' q, k, v, o and MLP, 4 bits
    assert decode_bound.weight_bytes(frozen, lora, jnp.bfloat16) == quantized + rest + adapters
    assert decode_bound.weight_bytes(frozen, lora, jnp.bfloat16, 1.0) == 4 * codes + rest + adapters
    cache = KVCache.empty(model.config, 3, 48, jnp.bfloat16)
    assert decode_bound.cache_bytes(model.config, 3, 48, jnp.bfloat16, False) == sum(
        a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
    assert decode_bound.memory_bandwidth(SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")) == 4.8e12
    h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert decode_bound.memory_bandwidth(h100) == 3.35e12
    assert decode_bound.memory_bandwidth(SimpleNamespace(platform="cpu", device_kind="cpu")) is None
