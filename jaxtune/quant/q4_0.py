"""llama.cpp's q4_0 blocks, computed in JAX (on the GPU when there is one; an 8B export quantizes in seconds).

A block is 32 consecutive weights of a row: an f16 scale d = (the weight of largest magnitude) / -8, then 16 bytes
of 4-bit codes q = trunc(w / d + 8.5) clipped to 15, weight j in the low nibble of byte j and weight 16 + j in its
high nibble; w is read back as d * (q - 8). Byte-equal to ggml's reference quantizer (`quantize_row_q4_0_ref`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # weights per block
BLOCK_BYTES = 2 + BLOCK // 2  # f16 scale + 16 bytes of codes


def _in_blocks(w: jax.Array) -> jax.Array:
    return w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)


def _block_scales(blocks: jax.Array, half: int = 8) -> jax.Array:
    """Each block's d [..., blocks, 1]: its weight of largest magnitude (the first on ties, as ggml's scan) / -half
    (8 for q4_0, 16 for q5_0)."""
    return jnp.take_along_axis(blocks, jnp.argmax(jnp.abs(blocks), axis=-1, keepdims=True), axis=-1) / -half


def _codes(blocks: jax.Array, inverse: jax.Array, half: int = 8) -> jax.Array:
    """The 4-bit (5-bit with half 16) codes, as float32, of blocks scaled by 1 / d."""
    scaled = jax.lax.optimization_barrier(blocks * inverse)  # rounded before the add, as ggml: no fused multiply-add
    return jnp.minimum(jnp.trunc(scaled + (half + 0.5)), 2 * half - 1)


@jax.jit
def _scales(w: jax.Array) -> jax.Array:
    return _block_scales(_in_blocks(w))


@jax.jit
def _pack(w: jax.Array, d: jax.Array, inverse: jax.Array) -> jax.Array:
    codes = _codes(_in_blocks(w), inverse).astype(jnp.uint8)
    packed = codes[..., :BLOCK // 2] | (codes[..., BLOCK // 2:] << 4)
    scale_bytes = jax.lax.bitcast_convert_type(d.astype(jnp.float16), jnp.uint8).reshape(*d.shape[:-1], 2)
    return jnp.concatenate([scale_bytes, packed], axis=-1).reshape(*w.shape[:-1], -1)


def quantize_q4_0(w: np.ndarray | jax.Array) -> np.ndarray:
    """The q4_0 bytes [..., K / 32 * 18] of a float tensor [..., K] (K a multiple of 32), as GGUF stores them."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"q4_0 quantizes rows of whole {BLOCK}-weight blocks; a row has {w.shape[-1]} weights")
    w = jnp.asarray(w)
    d = np.asarray(_scales(w))
    with np.errstate(divide="ignore", over="ignore"):  # 1 / d on the host: IEEE-rounded, as ggml's (a GPU's
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)  # reciprocal may differ in the last bit)
    return np.asarray(_pack(w, jnp.asarray(d), jnp.asarray(inverse, jnp.float32)))


def round_trip_q4_0(w: jax.Array, half: int = 8) -> jax.Array:
    """W [..., K] as a q4_0 file reads it back, traced (QAT): d * (q - 8), d in float16; with `half` 16, as a q5_0
    file does (5-bit codes, the same blocks). The reciprocal is the device's, so a code on a rounding edge may
    differ from the export's."""
    blocks = _in_blocks(w)
    d = _block_scales(blocks, half)
    codes = _codes(blocks, jnp.where(d == 0, 0.0, 1 / jnp.where(d == 0, 1.0, d)), half)
    return (d.astype(jnp.float16).astype(jnp.float32) * (codes - half)).reshape(w.shape)


@jax.jit
def dequantize_q4_0(data: jax.Array) -> jax.Array:
    """The float32 weights [..., K] of q4_0 bytes [..., K / 32 * 18]."""
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // BLOCK_BYTES, BLOCK_BYTES)
    d = jax.lax.bitcast_convert_type(blocks[..., :2].reshape(*blocks.shape[:-1], 1, 2), jnp.float16)
    codes = jnp.concatenate([blocks[..., 2:] & 0x0F, blocks[..., 2:] >> 4], axis=-1).astype(jnp.float32) - 8
    return (d.astype(jnp.float32) * codes).reshape(*data.shape[:-1], -1)
