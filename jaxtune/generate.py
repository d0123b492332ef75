"""Batched text generation with a KV cache: one prefill, then a compiled decode loop."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune.errors import ConfigError
from jaxtune.models.causal_lm import CausalLM, KVCache

Prompt = str | Sequence[dict[str, str]]


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """Refuses decoding options out of range (the CLI calls it before a model loads)."""
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}; 0 decodes greedily")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}; 1.0 samples from the whole distribution")

# decoding with a KV cache per layer, one traced layer per decoder layer (`KVCache`): a GPU's decode step 1.3x
# faster at 64 rows for a compile ~40 s longer at 8B. None: the callers' defaults (GRPO's rollouts, sampled every step
# of a run, on a GPU; `generate`, often a few short calls, never)
PER_LAYER_CACHE: bool | None = None


def per_layer_cache(default: bool) -> bool:
    return default if PER_LAYER_CACHE is None else PER_LAYER_CACHE


_BUCKET = 16  # prompt and cache lengths are rounded up to this, so nearby lengths share one compilation


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def eos_token_ids(model: CausalLM, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids from the tokenizer, config.json and generation_config.json (chat models often declare
    several: Qwen2.5-Instruct's turn end and its text end), every id transformers' generate and TRL stop at."""
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None), model.config.eos_token_id,
                   model.config.generation_eos_token_ids):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return tuple(sorted(ids))


def encode_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a plain string (with the tokenizer's BOS) or a chat message list (chat template)."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def sample_token(logits: jax.Array, key: jax.Array, temperature: float, top_p: float, top_k: int = 0) -> jax.Array:
    """One token per row of logits [B, V]: greedy at temperature 0, else drawn from softmax(logits / temperature)
    within the top k and the top-p nucleus."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:  # the k most likely tokens only (ties at the k-th value kept)
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def prompt_layout(pad: jax.Array, prompt_len: int) -> tuple[jax.Array, jax.Array]:
    """(segment ids, positions) [B, prompt_len] of left-padded prompts (pad: each row's padding): the padding is
    segment 0, never attended by real tokens, and each prompt's positions start at 0 at its first token."""
    idx = jnp.arange(prompt_len, dtype=jnp.int32)[None]
    return (idx >= pad[:, None]).astype(jnp.int32), jnp.maximum(idx - pad[:, None], 0)


def decode(model: CausalLM, ids: jax.Array, pad: jax.Array, key: jax.Array, *, max_new_tokens: int, cache_len: int,
           temperature: float, top_p: float, eos_ids: tuple[int, ...], top_k: int = 0,
           ignore_eos: bool = False, per_layer: bool = False) -> jax.Array:
    """New tokens [batch, max_new_tokens] after left-padded prompts ids [batch, P] (pad: each row's padding),
    -1 after a row's EOS (the EOS kept); one prefill, then a while loop of single-token steps on a KV cache that
    ends when every row is done. `ignore_eos`: EOS is never sampled (benchmarks: every row runs its full length).
    `per_layer`: a KV cache per layer (`KVCache`; faster on a GPU, slower to compile).
    Traced inside a caller's jit."""
    batch, prompt_len = ids.shape
    seg, pos = prompt_layout(pad, prompt_len)
    cache = KVCache.empty(model.config, batch, cache_len, model.dtype, per_layer=per_layer)
    logits, cache = model.forward_with_cache(ids, pos, seg, cache, jnp.int32(0), last_only=True)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def pick(logits, key):
        if ignore_eos and eos_ids:
            logits = logits.at[:, eos].set(-jnp.inf)
        return sample_token(logits, key, temperature, top_p, top_k)

    key, sub = jax.random.split(key)
    first = pick(logits[:, -1], sub)

    def cond(carry):
        i, _, _, done, _, _ = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, out, tok, done, cache, key = carry
        out = out.at[:, i].set(jnp.where(done, -1, tok))
        done = done | jnp.isin(tok, eos)
        step_pos = (prompt_len - pad + i)[:, None]
        logits, cache = model.forward_with_cache(
            tok[:, None], step_pos, jnp.ones((batch, 1), jnp.int32), cache, prompt_len + i
        )
        key, sub = jax.random.split(key)
        return i + 1, out, pick(logits[:, 0], sub), done, cache, key

    out = jnp.full((batch, max_new_tokens), -1, jnp.int32)
    init = (jnp.int32(0), out, first, jnp.zeros((batch,), bool), cache, key)
    return jax.lax.while_loop(cond, body, init)[1]


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_len", "temperature", "top_p", "eos_ids",
                              "per_layer")
)
def _generate_ids(
    graphdef, state, ids, pad, key, *, max_new_tokens, cache_len, temperature, top_p, eos_ids, per_layer
) -> jax.Array:
    model = nnx.merge(graphdef, state)
    model.prepare_for_kernels()  # the kernels' scales once, not once per token
    return decode(model, ids, pad, key, max_new_tokens=max_new_tokens, cache_len=cache_len, temperature=temperature,
                  top_p=top_p, eos_ids=eos_ids, per_layer=per_layer)


def prompt_bucket(length: int) -> int:
    """The padded prompt length a prompt of `length` tokens is decoded at (a multiple of 16)."""
    return _round_up(length, _BUCKET)


def left_padded(prompt_ids: Sequence[Sequence[int]], pad_id: int,
                longest: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids [N, P], each row's padding [N]): prompts right-aligned in rows of P, a multiple of 16 (nearby lengths
    share one compilation); `longest`: P fits prompts of that many tokens (every batch of a run padded alike)."""
    prompt_len = prompt_bucket(max(max(len(p) for p in prompt_ids), longest or 0))
    ids = np.full((len(prompt_ids), prompt_len), pad_id, np.int32)
    pad = np.zeros(len(prompt_ids), np.int32)
    for row, p in enumerate(prompt_ids):
        ids[row, prompt_len - len(p):] = p
        pad[row] = prompt_len - len(p)
    return ids, pad


def cache_length(prompt_len: int, max_new_tokens: int) -> int:
    return _round_up(prompt_len + max_new_tokens, _BUCKET)


def generate_tokens(
    model: CausalLM,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
) -> list[list[int]]:
    """New token ids per prompt (EOS excluded), prompts of any lengths batched with left padding."""
    if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
        raise ConfigError("every prompt needs at least one token; pass non-empty prompts")
    check_sampling(max_new_tokens, temperature, top_p)
    ids, pad = left_padded(prompt_ids, pad_id)
    graphdef, state = nnx.split(model)
    out = _generate_ids(
        graphdef, state, jnp.asarray(ids), jnp.asarray(pad), jax.random.key(seed),
        max_new_tokens=max_new_tokens, cache_len=cache_length(ids.shape[1], max_new_tokens),
        temperature=float(temperature), top_p=float(top_p), eos_ids=tuple(int(e) for e in eos_ids),
        per_layer=per_layer_cache(False),
    )
    results = []
    for row in np.asarray(out):
        tokens = []
        for t in row.tolist():
            if t < 0 or t in eos_ids:
                break
            tokens.append(t)
        results.append(tokens)
    return results


def generate(
    model: CausalLM,
    tokenizer: Any,
    prompts: Prompt | Sequence[Prompt],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> list[str]:
    """Completions for one or more prompts: strings, or chat message lists rendered with the chat template.

    Greedy when temperature == 0, else nucleus sampling (top_p) from a fixed seed. Stops each row at EOS.
    """
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict)):
        prompts = [prompts]  # a single prompt
    prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    new = generate_tokens(
        model, prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
        eos_ids=eos_token_ids(model, tokenizer), pad_id=pad_id,
    )
    return [tokenizer.decode(t, skip_special_tokens=True) for t in new]
