"""The plain modules every block is built of: a dense projection in HF's [out, in] layout, RMSNorm, the token
embedding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune import ops

_INIT_STD = 0.02


class Linear(nnx.Module):
    """Dense projection with an HF-layout weight [out, in]."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (out_features, in_features), dtype))
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        return ops.linear(x, self.weight[...], None if self.bias is None else self.bias[...])


class RMSNorm(nnx.Module):
    """x / rms(x) times the weight; with `offset` (Qwen3.5's zero-centred weights) times 1 + weight, in float32."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype, offset: bool = False):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if offset else jnp.ones((dim,), dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array, output_scale: float | None = None) -> jax.Array:
        """`output_scale`: also times this, in float32 before the cast (one rounding)."""
        normed = rms_normalize(x, self.eps)
        if output_scale is not None:
            return (normed * self.weight[...].astype(jnp.float32) * output_scale).astype(x.dtype)
        if self.offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis in float32: RMSNorm without a scale (Gemma 4's value norm)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (vocab, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        table = self.weight[...]
        if jax.typeof(table).memory_space == jax.memory.Space.Host:  # training's offload_embedding: copied in for
            table = jax.device_put(table, jax.memory.Space.Device)  # the lookup only (training/embedding_offload.py)
        return jnp.take(table, ids, axis=0)
