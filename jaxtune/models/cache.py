"""What decoding carries from step to step: the attention layers' KV cache (stacked or per layer) and, for a
hybrid decoder, the Gated DeltaNet layers' windows and states."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.models.blocks.gated_deltanet import LinearCache
from jaxtune.models.config import ModelConfig
from jaxtune.errors import UnsupportedModelError
from jaxtune.models.layer_kinds import DEFAULT, SLIDING, attention_geometry, attention_layers


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
    program with no cache slice copied, which runs faster and compiles slower."""

    k: jax.Array | tuple[jax.Array, ...]
    v: jax.Array | tuple[jax.Array, ...]
    segment_ids: jax.Array
    # a hybrid decoder's Gated DeltaNet layers: their conv windows and recurrent states (the KV stacks then hold
    # the attention layers only)
    linear: LinearCache | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, length: int, dtype: jnp.dtype, per_layer: bool = False) -> "KVCache":
        if cfg.full_head_dim and attention_geometry(cfg, DEFAULT)[:2] != attention_geometry(cfg, SLIDING)[:2]:
            raise UnsupportedModelError(
                f"generation (and GRPO's rollouts) for {cfg.model_type} models whose full-attention layers have their "
                "own head size or KV heads is not supported yet: the KV cache holds one geometry; training and "
                "exports work")
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        segments = jnp.zeros((batch, length), jnp.int32)
        layers = attention_layers(cfg)
        linear = cfg.num_layers - layers
        linear = LinearCache.empty(cfg, linear, batch, dtype) if linear else None
        if per_layer:
            return cls(*(tuple(jnp.zeros(shape, dtype) for _ in range(layers)) for _ in "kv"), segments, linear)
        return cls(jnp.zeros((layers, *shape), dtype), jnp.zeros((layers, *shape), dtype), segments, linear)
