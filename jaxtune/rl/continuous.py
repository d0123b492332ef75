"""Continuous batching: completions decoded in a fixed number of slots, each slot refilled with the next prompt as
soon as its completion ends, in one compiled program.

A static batch decodes until its longest row ends: with GRPO's completions ranging from tens of tokens to the
maximum, most rows idle most of the time, and a rollout larger than the device's cache runs call after call, each
to its own longest row. Here the cache holds `slots` rows, never one per completion. It is a ring: every slot
writes its step's token at one shared index (the clock, mod the cache's length), and a slot refilled at clock c
holds its new prompt at [c - P, c) mod S, so a completion of at most `max_new_tokens` never wraps onto its own
entries; what the previous completion left is emptied (segment 0). The attention of a step sees only its row's
entries (`ops.context.ring_kv_cache`). A refill prefills up to `refill_rows` prompts at once on a cache of their
own and copies it into the free slots (`models.cache_rows.place_rows`); a freed slot idles until that many are
free (or the prompts left are fewer), since a prefill costs a decoding step's weight reads however few rows it has.

Token t of completion n is drawn with the key fold_in(fold_in(key, n), t), so what a completion samples does not
depend on the slot, the other rows or when it started: the same tokens as one row decoded alone.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.generate import prompt_layout, sample_token
from jaxtune.models.cache import KVCache
from jaxtune.models.cache_rows import place_rows
from jaxtune.ops.context import ring_kv_cache


class Slots(NamedTuple):
    """What the loop carries."""
    clock: jax.Array  # the next step's cache index before the mod: every slot writes there
    cache: KVCache
    row: jax.Array  # [slots] the completion each slot decodes
    count: jax.Array  # [slots] tokens it has emitted
    token: jax.Array  # [slots] the last of them: the next step's input
    position: jax.Array  # [slots] that token's position in its sequence
    active: jax.Array  # [slots] still decoding
    next_row: jax.Array  # the first completion not started
    out: jax.Array  # [N, max_new_tokens], -1 past a completion's end
    steps: jax.Array  # decoding steps run
    prefills: jax.Array  # refill prefills run


def refill_rows_for(slots: int) -> int:
    """The default prompts a refill prefills at once: an eighth of the slots."""
    return max(1, slots // 8)


def completion_key(key: jax.Array, row: jax.Array, token: jax.Array) -> jax.Array:
    """The key token `token` of completion `row` is sampled with."""
    return jax.random.fold_in(jax.random.fold_in(key, row), token)


def decode_continuous(model, ids: jax.Array, pad: jax.Array, key: jax.Array, *, slots: int, refill_rows: int,
                      max_new_tokens: int, cache_len: int, temperature: float, top_p: float, top_k: int,
                      eos_ids: tuple[int, ...], ignore_eos: bool = False, per_layer: bool = False
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(completions [N, max_new_tokens] with -1 after each one's EOS (the EOS kept), decoding steps run, refill
    prefills run) of the left-padded prompts ids [N, P] (pad: each row's padding). `cache_len` >= P +
    max_new_tokens. Traced inside a caller's jit."""
    n, p = ids.shape
    if cache_len < p + max_new_tokens:
        raise ValueError(f"a ring of {cache_len} entries cannot hold {p} prompt + {max_new_tokens} new tokens")
    r = max(1, min(refill_rows, slots))
    cfg, dtype = model.config, model.dtype
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)
    # a refill past the last prompt reads these rows (one token each; what they give is dropped)
    ids = jnp.concatenate([ids, jnp.zeros((r, p), ids.dtype)])
    pad = jnp.concatenate([pad, jnp.full((r,), p - 1, pad.dtype)])

    def pick(logits, rows, counts):
        if ignore_eos and eos_ids:
            logits = logits.at[:, eos].set(-jnp.inf)
        keys = jax.vmap(functools.partial(completion_key, key))(rows, counts)
        return jax.vmap(lambda lg, k: sample_token(lg[None], k, temperature, top_p, top_k)[0])(logits, keys)

    def ends(token, count):
        return jnp.isin(token, eos) | (count >= max_new_tokens)

    def refill(st: Slots) -> Slots:
        free = jnp.nonzero(~st.active, size=r, fill_value=slots)[0].astype(jnp.int32)
        rows = st.next_row + jnp.arange(r, dtype=jnp.int32)
        valid = (free < slots) & (rows < n)
        target = jnp.where(valid, free, slots)  # out of range: dropped
        part = jax.lax.dynamic_slice_in_dim(ids, st.next_row, r)
        part_pad = jax.lax.dynamic_slice_in_dim(pad, st.next_row, r)
        seg, pos = prompt_layout(part_pad, p)
        prefill = KVCache.empty(cfg, r, p, dtype, per_layer=per_layer)
        logits, prefill = model.forward_with_cache(part, pos, seg, prefill, jnp.int32(0), last_only=True)
        first = pick(logits[:, -1], rows, jnp.zeros((r,), jnp.int32))
        ones = jnp.ones((r,), jnp.int32)
        return st._replace(
            cache=place_rows(st.cache, prefill, target, st.clock - p),
            row=st.row.at[target].set(rows, mode="drop"), count=st.count.at[target].set(ones, mode="drop"),
            token=st.token.at[target].set(first, mode="drop"),
            position=st.position.at[target].set(p - part_pad, mode="drop"),
            active=st.active.at[target].set(~ends(first, ones), mode="drop"),
            next_row=st.next_row + jnp.sum(valid, dtype=jnp.int32),
            out=st.out.at[jnp.where(valid, rows, n), 0].set(first, mode="drop"), prefills=st.prefills + 1)

    def refill_all(st: Slots, eager: bool = False) -> Slots:
        """Refills while `refill_rows` slots are free (fewer where fewer prompts are left; `eager`: any): a prefill
        reads every weight as a decoding step does, so an idle slot waits for others rather than take its own."""
        def wanted(s):
            free = jnp.sum(~s.active, dtype=jnp.int32)
            left = n - s.next_row
            return (left > 0) & (free >= (1 if eager else jnp.minimum(r, left)))

        return jax.lax.while_loop(wanted, refill, st)

    def step(st: Slots) -> Slots:
        with ring_kv_cache():
            logits, cache = model.forward_with_cache(st.token[:, None], st.position[:, None],
                                                     jnp.ones((slots, 1), jnp.int32), st.cache, st.clock % cache_len)
        token = pick(logits[:, 0], st.row, st.count)
        out = st.out.at[jnp.where(st.active, st.row, n), st.count].set(token, mode="drop")
        count = st.count + st.active.astype(jnp.int32)
        st = st._replace(clock=st.clock + 1, cache=cache, count=count, token=token, position=st.position + 1,
                         active=st.active & ~ends(token, count), out=out, steps=st.steps + 1)
        return refill_all(st)

    zeros = jnp.zeros((slots,), jnp.int32)
    start = Slots(jnp.int32(p), KVCache.empty(cfg, slots, cache_len, dtype, per_layer=per_layer), zeros, zeros,
                  zeros, zeros, jnp.zeros((slots,), bool), jnp.int32(0),
                  jnp.full((n, max_new_tokens), -1, jnp.int32), jnp.int32(0), jnp.int32(0))
    done = jax.lax.while_loop(lambda s: jnp.any(s.active), step, refill_all(start, eager=True))
    return done.out, done.steps, done.prefills

