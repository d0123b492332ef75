"""Quantization-aware training: what a weight becomes in the 4-bit format it will be deployed in, so the forward pass
sees the exported model (the adapters' gradient passes straight through the rounding: `qlora.LoRALinear`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune import nf4
from jaxtune.quant.q4_0 import BLOCK as Q4_0_BLOCK

FORMATS = ("q4_0", "nf4")


def q4_0_round_trip(w: jax.Array) -> jax.Array:
    """W [..., K] as a q4_0 file reads it back: d * (q - 8) per block of 32 along K, d in float16."""
    blocks = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // Q4_0_BLOCK, Q4_0_BLOCK)
    d = jnp.take_along_axis(blocks, jnp.argmax(jnp.abs(blocks), axis=-1, keepdims=True), axis=-1) / -8
    inverse = jnp.where(d == 0, 0.0, 1 / jnp.where(d == 0, 1.0, d))
    codes = jnp.minimum(jnp.trunc(blocks * inverse + 8.5), 15)
    return (d.astype(jnp.float16).astype(jnp.float32) * (codes - 8)).reshape(w.shape)


def nf4_round_trip(w: jax.Array) -> jax.Array:
    """W [out, in] as its NF4 re-quantization (bitsandbytes' format, double-quantized scales) reads back."""
    return nf4.dequantize(nf4.quantize_traced(w.astype(jnp.float32)))


def round_trip(w: jax.Array, fmt: str) -> jax.Array:
    """`w` [out, in] as the `fmt` export stores it and a loader reads it back (float32)."""
    return {"q4_0": q4_0_round_trip, "nf4": nf4_round_trip}[fmt](w)
