"""What decoding carries from step to step: the attention layers' KV cache (stacked or per layer) and, for a
hybrid decoder, the Gated DeltaNet layers' windows and states."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.models.blocks.gated_deltanet import LinearCache
from jaxtune.models.config import ModelConfig
from jaxtune.models.layer_kinds import GATED_DELTANET, attention_geometry, attention_layers, kv_shared, layer_kind


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
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        segments = jnp.zeros((batch, length), jnp.int32)
        layers = attention_layers(cfg)
        linear = sum(layer_kind(cfg, i) == GATED_DELTANET for i in range(cfg.num_layers))
        linear = LinearCache.empty(cfg, linear, batch, dtype) if linear else None
        shapes = [(batch, length, *attention_geometry(cfg, layer_kind(cfg, i))[1::-1])
                  for i in range(cfg.num_layers) if layer_kind(cfg, i) != GATED_DELTANET
                  and not kv_shared(layer_kind(cfg, i))]
        # layers of several geometries (Gemma 4), or run one by one (its small models): one array each
        if per_layer or len(set(shapes)) > 1 or cfg.per_layer_dim or cfg.num_kv_shared_layers:
            return cls(*(tuple(jnp.zeros(s, dtype) for s in shapes) for _ in "kv"), segments, linear)
        return cls(jnp.zeros((layers, *shape), dtype), jnp.zeros((layers, *shape), dtype), segments, linear)
