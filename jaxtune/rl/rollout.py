"""Completions sampled from the policy being trained (NF4 base + the current adapters, nothing copied), and the
training rows they make."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.multihost_utils import process_allgather
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtune.data.packing import IGNORE
from jaxtune.data.sources import DataError, Row
from jaxtune.generate import cache_length, decode, encode_prompt, left_padded, per_layer_cache, prompt_bucket
from jaxtune.rl.continuous import decode_continuous, refill_rows_for
from jaxtune.parallel.sharding import BATCH_AXES, global_rows


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


# None: decode from weights dequantized once per rollout wherever they fit beside the cache (one device, per-layer
# caches): every layer's where all fit, else as many leading layers' as fit, the rest from the codes; False / True:
# never / always. Measured on an H200 (benchmarks/results/2026-11-28-grpo-dense-rollout-h200.md): the 8B GRPO step
# 7.98 s where decoding from the codes per token takes 10.88 s (27.6 GiB against 25.0 GiB); under a 24 GB card's cap
# the planner kept the codes (11.68 s at 14.9 GiB) before it could copy part of the layers
DENSE_ROLLOUT: bool | None = None


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "cache_len", "temperature", "top_p",
                                             "top_k", "eos_ids", "ignore_eos", "per_layer", "dense"))
def sample(graphdef, lora, frozen, ids, pad, key, *, max_new_tokens: int, cache_len: int, temperature: float,
           top_p: float, top_k: int, eos_ids: tuple[int, ...], ignore_eos: bool = False,
           per_layer: bool = False, dense: int = 0) -> jax.Array:
    """Completions [N, max_new_tokens] (-1 after EOS) of left-padded prompts under the adapters `lora`. `dense`
    (with `per_layer`): the NF4 base of the first `dense` decoder layers (-1: every layer) dequantized once for the
    whole rollout, each token's GEMMs reading that copy (the same bits as the per-token dequantization, at the
    memory of a 16-bit base for those layers); the other layers decode from the codes."""
    return decode(_sampling_model(graphdef, lora, frozen, per_layer, dense), ids, pad, key,
                  max_new_tokens=max_new_tokens, cache_len=cache_len, temperature=temperature, top_p=top_p,
                  top_k=top_k, eos_ids=eos_ids, ignore_eos=ignore_eos, per_layer=per_layer)


@functools.partial(jax.jit, static_argnames=("graphdef", "slots", "refill_rows", "max_new_tokens", "cache_len",
                                             "temperature", "top_p", "top_k", "eos_ids", "ignore_eos", "per_layer",
                                             "dense"))
def sample_continuous(graphdef, lora, frozen, ids, pad, key, *, slots: int, refill_rows: int, max_new_tokens: int,
                      cache_len: int, temperature: float, top_p: float, top_k: int, eos_ids: tuple[int, ...],
                      ignore_eos: bool = False, per_layer: bool = False, dense: int = 0):
    """`sample` by continuous batching (`continuous.decode_continuous`): (completions, decoding steps, prefills)."""
    return decode_continuous(_sampling_model(graphdef, lora, frozen, per_layer, dense), ids, pad, key, slots=slots,
                             refill_rows=refill_rows, max_new_tokens=max_new_tokens, cache_len=cache_len,
                             temperature=temperature, top_p=top_p, top_k=top_k, eos_ids=eos_ids,
                             ignore_eos=ignore_eos, per_layer=per_layer)


def _sampling_model(graphdef, lora, frozen, per_layer: bool, dense: int):
    """The policy a traced sampler decodes with: the kernels' scales prepared once per rollout (not once per token)
    and, with `dense` and `per_layer`, the first `dense` layers' base dequantized once (-1: every layer)."""
    model = nnx.merge(graphdef, lora, frozen)
    model.prepare_for_kernels()
    if dense and per_layer:
        model.prepare_dense_weights(None if dense < 0 else dense)
    return model


def sampler_options(max_new_tokens: int, prompt_len: int, temperature: float, top_p: float, top_k: int,
                    eos_ids: Sequence[int], ignore_eos: bool, dense: bool | int = 0) -> dict[str, Any]:
    """The sampler's static options for prompts of `prompt_len` (padded) tokens: the cache's length, the per-layer
    cache where the backend decodes faster with it, the dense layers only with it."""
    per_layer = per_layer_cache(jax.default_backend() == "gpu")
    return dict(max_new_tokens=max_new_tokens, cache_len=cache_length(prompt_len, max_new_tokens),
                temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                eos_ids=tuple(int(e) for e in eos_ids), ignore_eos=ignore_eos, per_layer=per_layer,
                dense=dense_layers(dense) if per_layer else 0)


def dense_layers(dense: bool | int) -> int:
    """The sampler's static `dense`: -1 every layer (True), 0 none (False), else that many leading layers (an int
    apart from the bools: a jit cache would take True for 1)."""
    return -1 if dense is True else int(dense)


class RolloutStats(NamedTuple):
    """How a rollout decoded: decoding steps (each reads every weight once) and the rows they carried, and its
    prefills (a static call's one, or continuous batching's refills)."""
    steps: int
    rows: int
    prefills: int


def sample_completions(graphdef, lora, frozen, prompt_ids: list[list[int]], key: jax.Array, **options) -> np.ndarray:
    """`sample_rollout`'s completions."""
    return sample_rollout(graphdef, lora, frozen, prompt_ids, key, **options)[0]


def sample_rollout(graphdef, lora, frozen, prompt_ids: list[list[int]], key: jax.Array, *, max_new_tokens: int,
                   temperature: float, top_p: float, top_k: int, eos_ids: tuple[int, ...], pad_id: int,
                   ignore_eos: bool = False, rows_per_call: int | None = None, mesh=None,
                   dense: bool | int = 0, continuous: bool = False,
                   longest_prompt: int | None = None) -> tuple[np.ndarray, RolloutStats]:
    """(completions [N, max_new_tokens] of the prompts, how they decoded), `rows_per_call` rows at a time (None: all
    in one call). In several static calls each takes its own key, folded from `key` by the call's index, and runs
    to its longest completion; with `continuous` (one device) they run as one call of `rows_per_call` slots, each
    refilled with the next prompt as its completion ends (`continuous.decode_continuous`, its keys per completion).
    On a mesh each device samples its share of the rows (split as the training step splits a micro-batch); every
    process gets all of them. `dense`: from the base dequantized once per call (`sample`; True: every layer, n: the
    first n). `longest_prompt`: the prompts padded for that many tokens, so every rollout of a run has one shape."""
    ids, pad = left_padded(prompt_ids, pad_id, longest_prompt)  # one prompt length for every call: one compilation
    options = sampler_options(max_new_tokens, ids.shape[1], temperature, top_p, top_k, eos_ids, ignore_eos, dense)
    step = rows_per_call or len(ids)
    if continuous and mesh is None and step < len(ids):
        out, steps, prefills = sample_continuous(graphdef, lora, frozen, jnp.asarray(ids), jnp.asarray(pad), key,
                                                 slots=step, refill_rows=refill_rows_for(step), **options)
        return np.asarray(out), RolloutStats(int(steps), step, int(prefills))

    def call(s: int, key: jax.Array) -> np.ndarray:
        part_ids, part_pad = ids[s:s + step], pad[s:s + step]
        if mesh is None:
            return np.asarray(sample(graphdef, lora, frozen, jnp.asarray(part_ids), jnp.asarray(part_pad), key,
                                     **options))
        with jax.set_mesh(mesh):
            out = sample(graphdef, lora, frozen, global_rows(mesh, part_ids), global_rows(mesh, part_pad), key,
                         **options)
        return np.asarray(process_allgather(out, tiled=True))

    if step >= len(ids):
        out = call(0, key)
    else:
        out = np.concatenate([call(s, jax.random.fold_in(key, s // step)) for s in range(0, len(ids), step)])
    # a static call's loop runs to its longest completion
    steps = sum(int((out[s:s + step] >= 0).sum(axis=1).max()) for s in range(0, len(ids), step))
    return out, RolloutStats(steps, min(step, len(ids)), len(range(0, len(ids), step)))


def sampling_bytes(graphdef, lora, frozen, rows: int, prompt_len: int, *, max_new_tokens: int, temperature: float,
                   top_p: float, top_k: int, eos_ids: Sequence[int], ignore_eos: bool = False, mesh=None,
                   dense: bool | int = 0) -> int:
    """Device bytes one sampling call of `rows` prompts of `prompt_len` tokens needs beside the weights it reads (the
    KV cache, the prefill's activations, the outputs): XLA's plan of the compiled sampler, nothing run (on a mesh,
    one device's share)."""
    prompt_len = prompt_bucket(prompt_len)
    split = {} if mesh is None else {"sharding": NamedSharding(mesh, P(BATCH_AXES))}
    ids = jax.ShapeDtypeStruct((rows, prompt_len), jnp.int32, **split)
    pad = jax.ShapeDtypeStruct((rows,), jnp.int32, **split)
    options = sampler_options(max_new_tokens, prompt_len, temperature, top_p, top_k, eos_ids, ignore_eos, dense)
    from jaxtune.training.autobatch import SIZING_OPTIONS_GPU  # the plan does not depend on the GEMM algorithms

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        compiled = sample.lower(graphdef, lora, frozen, ids, pad, jax.random.key(0), **options).compile(
            compiler_options=SIZING_OPTIONS_GPU if jax.default_backend() == "gpu" else None)
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def rows_per_call(total: int, fits: Callable[[int], bool], shards: int = 1) -> int | None:
    """The most rows (a divisor of `total` and a multiple of `shards`, so every call has the same shape and splits
    evenly over the devices) whose sampling `fits`; None: not even the smallest fits."""
    for rows in sorted((d for d in range(shards, total + 1, shards) if total % d == 0), reverse=True):
        if fits(rows):
            return rows
    return None


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
