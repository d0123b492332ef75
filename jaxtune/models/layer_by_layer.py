"""Decoders whose layers feed one another beyond the residual stream, run one traced layer per decoder layer: Gemma
4's small models, whose layers each read their own slice of a per-layer input, and whose last layers attend to the
keys and values of an earlier layer (KV sharing). The loops over stacks cannot pass an earlier layer's keys and
values forward with their gradient; here each is an ordinary value of the trace, so the layer that made them gets
the gradient of every layer that reads them. Each layer is rematerialized under the model's remat policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune import ops
from jaxtune.errors import UnsupportedModelError
from jaxtune.models.cache import LayerCache
from jaxtune.models.layer_kinds import (attention_position, full_rope, kv_shared, kv_source, layer_kind, layer_stacks,
                                        locate)
from jaxtune.models.layers import Embed, Linear, RMSNorm
from jaxtune.models.remat import remat_policy

# variables kept whole (read at the layer's index in place), as the stacked loops keep them
WHOLE = ("codes", "kernel_absmax", "fp8_scale", "fp8_block_scale", "dense")


def per_layer_inputs(model, input_ids: jax.Array, embeds: jax.Array) -> jax.Array:
    """Each token's input to every layer [B, T, layers, per_layer_dim]: its own embedding row (times
    sqrt(per_layer_dim)) and the projection of its scaled embedding (times 1/sqrt(hidden), normed per layer), summed
    and scaled by 1/sqrt(2), in the model's dtype as transformers computes them."""
    cfg = model.config
    shape = (*input_ids.shape, cfg.num_layers, cfg.per_layer_dim)
    dtype = embeds.dtype
    own = model.embed_tokens_per_layer(input_ids).astype(dtype) * jnp.asarray(cfg.per_layer_dim**0.5, dtype)
    projected = model.per_layer_model_projection(embeds) * jnp.asarray(cfg.hidden_size**-0.5, dtype)
    projected = model.per_layer_projection_norm(projected.reshape(shape))
    return (projected + own.reshape(shape)) * jnp.asarray(2.0**-0.5, dtype)


def per_layer_modules(cfg, dtype, rngs) -> dict[str, nnx.Module]:
    """The model-level modules of the per-layer inputs, by their hub names."""
    width = cfg.num_layers * cfg.per_layer_dim
    return {"embed_tokens_per_layer": Embed(cfg.per_layer_vocab_size, width, dtype=dtype, rngs=rngs),
            "per_layer_model_projection": Linear(cfg.hidden_size, width, bias=False, dtype=dtype, rngs=rngs),
            "per_layer_projection_norm": RMSNorm(cfg.per_layer_dim, eps=cfg.rms_norm_eps, dtype=dtype)}


def run_layers(model, h: jax.Array, tables: dict, segment_ids, cache, cache_seg, cache_index, layer_rngs,
               per_layer: jax.Array | None):
    """h after every decoder layer in order (and the per-layer KV cache tuples `cache` = (k, v), updated)."""
    cfg = model.config
    training = cache is None
    if training and model.remat_policy == "offload":
        raise UnsupportedModelError(f"remat 'offload' is not supported for {cfg.model_type} models with per-layer "
                                    "inputs or KV sharing; use remat 'selective' or 'full'")
    if training and model.router_aux and cfg.num_experts:
        raise UnsupportedModelError(f"the load-balancing loss is not supported for {cfg.model_type} models with "
                                    "per-layer inputs or KV sharing; set router_aux_loss_coef to 0")
    whole = nnx.Any(*(nnx.PathContains(name) for name in WHOLE))
    stacks = {}
    for stack in layer_stacks(cfg):
        layers = getattr(model, stack.attr) if training else model._kernel_ready_layers(stack.attr)
        stacks[stack.attr] = nnx.split(layers, whole, ...)
    # the layers whose keys and values a KV-sharing layer reads: only they hand them on
    sources = {kv_source(cfg, i) for i in range(cfg.num_layers) if kv_shared(layer_kind(cfg, i))}
    k, v = (None, None) if cache is None else (list(cache[0]), list(cache[1]))
    shared: dict[int, tuple] = {}
    for i in range(cfg.num_layers):
        stack, local = locate(cfg, i)
        graphdef, codes, sliced = stacks[stack.attr]
        cos, sin = tables[full_rope(cfg, stack.kind)]
        position = None if cache is None else attention_position(cfg, i)
        layer_cache = None if cache is None else LayerCache(k[position], v[position], None)

        def layer_call(h, sliced_i, rng, shared_kv, per_layer_i, *, graphdef=graphdef, codes=codes, local=local,
                       cos=cos, sin=sin, layer_cache=layer_cache, store=i in sources):
            layer = nnx.merge(graphdef, nnx.merge_state(codes, sliced_i))
            kv_out = [] if store else None
            with ops.stacked_layer(jnp.int32(local)), ops.static_layer(local):
                out, written = layer(h, cos, sin, segment_ids, layer_cache, cache_seg, cache_index, rng, None,
                                     per_layer_input=per_layer_i, shared_kv=shared_kv, kv_out=kv_out)
            return out, written, (kv_out[0] if store else None)

        if training and model.remat_policy != "none":
            layer_call = jax.checkpoint(layer_call, policy=remat_policy(model.remat_policy))
        sliced_i = jax.tree.map(lambda a, local=local: a[local], sliced)
        rng = None if layer_rngs is None else layer_rngs[i]
        shared_kv = shared.get(kv_source(cfg, i)) if kv_shared(stack.kind) and cache is None else None
        h, written, made = layer_call(h, sliced_i, rng, shared_kv,
                                      None if per_layer is None else per_layer[:, :, i])
        if made is not None:
            shared[i] = made
        if cache is not None and not kv_shared(stack.kind):
            k[position], v[position] = written.k, written.v
    return h, (None if cache is None else (tuple(k), tuple(v)))
