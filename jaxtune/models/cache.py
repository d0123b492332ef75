"""What decoding carries from step to step: the attention layers' KV cache (stacked or per layer) and, for a
hybrid decoder, the Gated DeltaNet layers' windows and states."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.models.blocks.gated_deltanet import LinearCache
from jaxtune.models.config import ModelConfig
from jaxtune.models.layer_kinds import (GATED_DELTANET, attention_geometry, holds_kv_cache, layer_kind,
                                        runs_layer_by_layer)


class LayerCache(NamedTuple):
    """The KV cache a layer reads and writes: every layer's k, v [L, B, S, Hkv, D] and this layer's index (the
    stacks are the layer loop's carry, so a step writes its new tokens in place instead of copying the cache); or,
    with `layer` None, this layer's own k, v [B, S, Hkv, D] (per-layer caches)."""

    k: jax.Array
    v: jax.Array
    layer: jax.Array | int | None = 0


class KVCache(NamedTuple):
    """KV cache for all layers: k, v stacked [L, B, S, Hkv, D], or tuples of L per-layer [B, S, Hkv, D];
    segment_ids [B, S] (0 = empty/padding).

    Stacked, the model runs its layers as a loop (one layer's program, compiled once). Per layer, it traces one
    layer per decoder layer and each writes and reads its own arrays: on a GPU a token's step is then one straight
    program with no cache slice copied, which runs faster and compiles slower. A model whose attention layers differ
    in head size or KV heads (Gemma 4's full layers) always has per-layer arrays, each of its layer's shape."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    segment_ids: jax.Array
    # a hybrid decoder's Gated DeltaNet layers: their conv windows and recurrent states (the KV stacks then hold
    # the attention layers only)
    linear: LinearCache | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int, dtype: jnp.dtype, per_layer: bool = False) -> "KVCache":
        segments = jnp.zeros((batch, length), jnp.int32)
        kinds = [layer_kind(cfg, i) for i in range(cfg.num_layers)]
        linear = kinds.count(GATED_DELTANET)
        linear = LinearCache.empty(cfg, linear, batch, dtype) if linear else None
        shapes = [(batch, length, *attention_geometry(cfg, kind)[1::-1]) for kind in kinds if holds_kv_cache(kind)]
        # layers of several geometries (Gemma 4), or run one by one (its small models): one array each
        if per_layer or len(set(shapes)) > 1 or runs_layer_by_layer(cfg):
            return cls(*(tuple(jnp.zeros(s, dtype) for s in shapes) for _ in "kv"), segments, linear)
        return cls(*(jnp.zeros((len(shapes), *shapes[0]), dtype) for _ in "kv"), segments, linear)
