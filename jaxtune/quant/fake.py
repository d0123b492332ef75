"""Quantization-aware training: what a weight becomes in the 4-bit format it will be deployed in, so the forward pass
sees the exported model (the adapters' gradient passes straight through the rounding: `qlora.LoRALinear`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.quant import nf4
from jaxtune.quant.k_quants_traced import round_trip_q4_k_m
from jaxtune.quant.q4_0 import round_trip_q4_0


def nf4_round_trip(w: jax.Array) -> jax.Array:
    """W [out, in] as its NF4 re-quantization (bitsandbytes' format, double-quantized scales) reads back."""
    return nf4.dequantize(nf4.quantize_traced(w.astype(jnp.float32)))


def round_trip(w: jax.Array, fmt: str) -> jax.Array:
    """`w` [out, in] as the `fmt` export stores it and a loader reads it back (float32)."""
    return {"q4_0": round_trip_q4_0, "q4_k": round_trip_q4_k_m, "nf4": nf4_round_trip}[fmt](w)
