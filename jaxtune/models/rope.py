"""Rotary position embeddings in the rotate_half convention that HF Llama-family checkpoints use."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxtune.models.config import ModelConfig


def unscaled_inverse_frequencies(theta: float, head_dim: int) -> np.ndarray:
    """theta^(-2i/d) per rotated pair [head_dim // 2], float64."""
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def llama3_inverse_frequencies(inv: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                               original_context: int) -> np.ndarray:
    """Llama 3.1's scaling: low frequencies divided by `factor`, high ones kept, the band between interpolated."""
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def yarn_inverse_frequencies(theta: float, dim: int, factor: float, beta_fast: float, beta_slow: float,
                             original_context: int, truncate: bool) -> np.ndarray:
    """YaRN's scaling: the pairs that turn fewer than `beta_slow` times over the original context are divided by
    `factor` (interpolated), those that turn more than `beta_fast` times are kept (extrapolated), and a linear ramp
    over the pair index blends the band between."""
    inv = unscaled_inverse_frequencies(theta, dim)

    def pair_turning(turns: float) -> float:  # the (fractional) pair index that turns `turns` times
        return dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(beta_fast), pair_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return inv / factor * ramp + inv * (1.0 - ramp)


def rotary_dim(cfg: ModelConfig) -> int:
    """How many of each head's dims RoPE rotates (the first ones; all but where `partial_rotary_factor` < 1)."""
    return int(cfg.head_dim * cfg.partial_rotary_factor)


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [rotary_dim // 2] in float64, with linear, llama3 or YaRN scaling applied."""
    inv = unscaled_inverse_frequencies(cfg.rope_theta, rotary_dim(cfg))
    if cfg.rope_type == "linear":
        return inv / cfg.rope_factor
    if cfg.rope_type == "llama3":
        return llama3_inverse_frequencies(inv, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                          cfg.rope_original_max_position)
    if cfg.rope_type == "yarn":
        return yarn_inverse_frequencies(cfg.rope_theta, rotary_dim(cfg), cfg.rope_factor, cfg.rope_beta_fast,
                                        cfg.rope_beta_slow, cfg.rope_original_max_position, cfg.rope_truncate)
    return inv


def proportional_inverse_frequencies(theta: float, head_dim: int, rotated: float) -> np.ndarray:
    """Gemma 4's full-attention RoPE [head_dim // 2]: theta^(-2i/head_dim) for the first `rotated` of the pairs and
    0 (no rotation) for the rest, so the tables span the whole head."""
    pairs = int(rotated * head_dim // 2)
    inv = 1.0 / (theta ** (np.arange(0, 2 * pairs, 2, dtype=np.float64) / head_dim))
    return np.concatenate([inv, np.zeros(head_dim // 2 - pairs)])


def rope_tables(cfg: ModelConfig, positions: jnp.ndarray, full: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos and sin [..., rotary_dim] in float32 for integer positions [...], times YaRN's attention factor; `full`:
    the full-attention layers' own RoPE (`layer_kinds.full_rope`)."""
    inv = jnp.asarray(proportional_inverse_frequencies(cfg.full_rope_theta, cfg.full_head_dim,
                                                       cfg.full_partial_rotary_factor) if full
                      else inverse_frequencies(cfg), dtype=jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)
    if cfg.rope_attention_factor != 1.0:
        return jnp.cos(angles) * cfg.rope_attention_factor, jnp.sin(angles) * cfg.rope_attention_factor
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [B, T, H, D] by cos/sin [B, T, D]; computed in float32, returned in x's dtype.

    Each half is rotated on its own and the halves joined once, in x's dtype: a rotate_half copy of x (a float32
    concatenation that XLA runs as its own kernel, fed to the multiply-add) is never formed. The tables' halves are
    equal (`rope_tables`), so the first half of each is used for both. Tables narrower than the head (partial
    RoPE) rotate its first dims and pass the rest through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :half], sin[:, :, None, :half]
    return jnp.concatenate([(x1 * c - x2 * s).astype(x.dtype), (x2 * c + x1 * s).astype(x.dtype)], axis=-1)
