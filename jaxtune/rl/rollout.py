"""Completions sampled from the policy being trained (NF4 base + the current adapters, nothing copied), and the
training rows they make."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune import nf4, ops
from jaxtune.data.packing import IGNORE
from jaxtune.data.sources import DataError, Row
from jaxtune.generate import cache_length, decode, encode_prompt, left_padded
from jaxtune.qlora import LoRALinear, NF4Linear, _projections


def check_prompt_rows(rows: Sequence[Row]) -> None:
    """Every row has a `prompt`: a string, or a list of chat messages (role / content strings)."""
    for row in rows:
        prompt = row.data.get("prompt")
        if isinstance(prompt, str) and prompt:
            continue
        if isinstance(prompt, list) and prompt and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prompt):
            continue
        raise DataError(f"{row.where}: field 'prompt' must be a non-empty string or a list of chat messages "
                        "({'role': ..., 'content': ...}); GRPO rows hold a prompt and any columns the rewards read")


def encode_prompts(rows: Sequence[Row], tokenizer: Any, max_prompt_tokens: int) -> list[list[int]]:
    """Each row's prompt ids (chat template for messages, the tokenizer's BOS for text, as TRL's GRPOTrainer);
    a prompt longer than `max_prompt_tokens` (seq_len - max_completion_length) is refused, naming its row."""
    out = []
    for row in rows:
        ids = encode_prompt(tokenizer, row.data["prompt"])
        if len(ids) > max_prompt_tokens:
            raise DataError(f"{row.where}: the prompt has {len(ids)} tokens, over the {max_prompt_tokens} that seq_len "
                            "leaves beside max_completion_length; raise seq_len or shorten the prompt")
        out.append(ids)
    return out


class MergedLinear(nnx.Module):
    """A projection as one dense weight [layers, out, in]: its NF4 base dequantized with the adapters' product added,
    so each decoding step runs one GEMM per projection (no dequantization, no LoRA products)."""

    def __init__(self, weight: jax.Array, bias: jax.Array | None):
        self.weight = nnx.Param(weight)
        self.bias = None if bias is None else nnx.Param(bias)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        return ops.linear(x, self.weight[...], None if self.bias is None else self.bias[...])


def merge_for_sampling(model) -> None:
    """Replaces every NF4 (+ LoRA) projection of a model local to a trace by its merged dense weight, one layer's
    float32 dequantization at a time (the model's dtype then holds every layer: 2 bytes per weight in bf16)."""
    for name, parent, proj in _projections(model):
        lora = proj if isinstance(proj, LoRALinear) else None
        base = lora.base if lora is not None else proj
        if not isinstance(base, NF4Linear):
            continue
        arrays = (base.codes[...], base.absmax_codes[...], base.nested_absmax[...], base.offset[...],
                  base.nested_map[...])
        adapters = (lora.lora_a[...], lora.lora_b[...]) if lora is not None else ()

        def one(xs, scale=lora.scale if lora is not None else 0.0):
            w = nf4.dequantize(nf4.NF4Weight(*xs[:5]), jnp.float32)
            if len(xs) > 5:
                a, b = xs[5].astype(jnp.float32), xs[6].astype(jnp.float32)
                w = w + scale * jnp.matmul(b, a, precision=jax.lax.Precision.HIGHEST)
            return w.astype(model.dtype)

        setattr(parent, name, MergedLinear(jax.lax.map(one, arrays + adapters),
                                           None if base.bias is None else base.bias[...]))


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_len", "temperature", "top_p",
                                             "top_k", "eos_ids", "ignore_eos", "merged"))
def sample(graphdef, lora, frozen, ids, pad, key, *, max_new_tokens: int, cache_len: int, temperature: float,
           top_p: float, top_k: int, eos_ids: tuple[int, ...], ignore_eos: bool = False,
           merged: bool = False) -> jax.Array:
    """Completions [N, max_new_tokens] (-1 after EOS) of left-padded prompts under the adapters `lora`; `merged`:
    from dense weights merged once for the rollout (`merge_for_sampling`) instead of the NF4 kernels."""
    model = nnx.merge(graphdef, lora, frozen)
    if merged:
        merge_for_sampling(model)
    else:
        model.prepare_for_kernels()  # the kernels' scales once per rollout, not once per token
    return decode(model, ids, pad, key, max_new_tokens=max_new_tokens, cache_len=cache_len,
                  temperature=temperature, top_p=top_p, top_k=top_k, eos_ids=eos_ids, ignore_eos=ignore_eos)


def sample_completions(graphdef, lora, frozen, prompt_ids: list[list[int]], key: jax.Array, *, max_new_tokens: int,
                       temperature: float, top_p: float, top_k: int, eos_ids: tuple[int, ...], pad_id: int,
                       ignore_eos: bool = False, merged: bool = False) -> np.ndarray:
    ids, pad = left_padded(prompt_ids, pad_id)
    out = sample(graphdef, lora, frozen, jnp.asarray(ids), jnp.asarray(pad), key, max_new_tokens=max_new_tokens,
                 cache_len=cache_length(ids.shape[1], max_new_tokens), temperature=float(temperature),
                 top_p=float(top_p), top_k=int(top_k), eos_ids=tuple(int(e) for e in eos_ids), ignore_eos=ignore_eos,
                 merged=merged)
    return np.asarray(out)


def completion_lists(completions: np.ndarray) -> list[list[int]]:
    """Each row's tokens up to and with its EOS (the -1 fill dropped)."""
    return [row[row >= 0].tolist() for row in completions]


def rollout_rows(prompt_ids: list[list[int]], completion_ids: list[list[int]], seq_len: int,
                 eos_ids: Sequence[int], mask_truncated: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(rows [N, seq_len] of prompt + completion, right-padded: input_ids, labels (the completion's tokens, where
    each is predicted), segment_ids, positions; which completions ended without EOS)."""
    n = len(prompt_ids)
    input_ids = np.zeros((n, seq_len), np.int32)
    labels = np.full((n, seq_len), IGNORE, np.int32)
    segment_ids = np.zeros((n, seq_len), np.int32)
    positions = np.zeros((n, seq_len), np.int32)
    truncated = np.zeros(n, bool)
    eos = set(int(e) for e in eos_ids)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        tokens = [*p, *c]
        k = len(tokens)
        input_ids[i, :k], segment_ids[i, :k], positions[i, :k] = tokens, 1, np.arange(k)
        truncated[i] = not c or c[-1] not in eos
        if c and not (mask_truncated and truncated[i]):
            labels[i, len(p) - 1:k - 1] = c
    return {"input_ids": input_ids, "labels": labels, "segment_ids": segment_ids, "positions": positions}, truncated
