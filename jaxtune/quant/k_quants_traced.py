"""The q4_K round trip traced in JAX, for quantization-aware training toward a Q4_K_M export.

The same scale search as `k_quants.py` (ggml's `quantize_row_q4_K_ref`: per 32-weight block the best of 21
asymmetric grids, then the blocks' scales and minimums rounded to 6 bits against an f16 super-block scale). On a CPU
its sums run in ggml's order, each product rounded before it is added, and the weights read back are those of
llama.cpp's bytes to the bit (tested); on a GPU the sums are XLA's fused ones (see `_ordered`). A row that is not
whole 256-weight super-blocks is read as q5_0, the type llama.cpp's quantizer falls back to for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.quant.q4_0 import round_trip_q4_0

QK_K = 256  # weights per super-block


def _ordered() -> bool:
    """ggml's order of sums and roundings where it is cheap (a CPU); on a GPU the fused sums XLA makes: one in
    ~300 blocks then picks the other of two grids whose errors differ in the last bits (measured), and the step
    is not slowed 20-fold by materializing every product."""
    return jax.default_backend() == "cpu"


def _rounded(x: jax.Array) -> jax.Array:
    """x rounded on its own before what follows (no fused multiply-add), where ggml's order is kept."""
    return jax.lax.optimization_barrier(x) if _ordered() else x


def _sum(terms: jax.Array) -> jax.Array:
    """The sum over the last axis: in ggml's order (a C loop from the first term, each term rounded) on a CPU,
    since the scale search compares errors that often differ in the last bits only."""
    if not _ordered():
        return terms.sum(-1)
    terms = _rounded(terms)
    acc = terms[..., 0]
    for i in range(1, terms.shape[-1]):
        acc = acc + terms[..., i]
    return acc


def _scale_and_min(x: jax.Array, w: jax.Array, nmax: int, rmin: float, rdelta: float, nstep: int):
    """ggml's make_qkx2_quants over the last axis of x with weights w: (scale, -min, codes as float32) of the grid
    scale * q + min (min <= 0) with the least weighted squared error among nstep + 1 trial scales, each trial
    starting from the best minimum so far."""
    mn = jnp.minimum(x.min(-1), 0.0)
    mx = x.max(-1)
    flat = mx == mn
    sum_w, sum_x = _sum(w), _sum(w * x)

    def grid(iscale_numerator, mn):
        iscale = iscale_numerator / jnp.where(flat, 1.0, mx - mn)
        return jnp.clip(jnp.round(_rounded(iscale[..., None] * (x - mn[..., None]))), 0, nmax)

    def error(scale, levels, mn):  # each product rounded before the add, as ggml's C
        return _sum(w * jnp.square(_rounded(scale[..., None] * levels) + mn[..., None] - x))

    codes = grid(jnp.float32(nmax), mn)
    scale = 1 / (nmax / jnp.where(flat, 1.0, mx - mn))
    best = error(scale, codes, mn)

    def trial(step, carry):
        codes, best, scale, mn = carry
        levels = grid(jnp.float32(rmin) + jnp.float32(rdelta) * step.astype(jnp.float32) + nmax, mn)
        wl = w * levels
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(wl * levels), _sum(wl * x)
        (w_l2, l_l, w_xl, x_l, l2_x, l_xl) = _rounded(  # products rounded, then subtracted
            (sum_w * sum_l2, sum_l * sum_l, sum_w * sum_xl, sum_x * sum_l, sum_l2 * sum_x, sum_l * sum_xl))
        det = w_l2 - l_l
        safe = jnp.where(det > 0, det, 1.0)
        this_scale = (w_xl - x_l) / safe
        this_min = (l2_x - l_xl) / safe
        positive = this_min > 0
        this_scale = jnp.where(positive, sum_xl / jnp.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_min = jnp.where(positive, 0.0, this_min)
        err = error(this_scale, levels, this_min)
        better = (det > 0) & (err < best) & ~flat
        return (jnp.where(better[..., None], levels, codes), jnp.where(better, err, best),
                jnp.where(better, this_scale, scale), jnp.where(better, this_min, mn))

    codes, _, scale, mn = jax.lax.fori_loop(0, nstep + 1, trial, (codes, best, scale, mn))
    return jnp.where(flat, 0.0, scale), -mn, jnp.where(flat[..., None], 0.0, codes)


def _six_bits(v: jax.Array) -> jax.Array:
    """nearest_int stored in a uint8, then at most 63 (ggml's MIN(63, ...))."""
    return jnp.minimum(jnp.round(v).astype(jnp.int32) & 0xFF, 63).astype(jnp.float32)


def _f16(v: jax.Array) -> jax.Array:
    return v.astype(jnp.float16).astype(jnp.float32)


def round_trip_q4_k(w: jax.Array) -> jax.Array:
    """W [..., K] (K a multiple of 256) as a q4_K tensor reads back: d * sc * q - dmin * m per 32-weight block."""
    x = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // QK_K, 8, 32)
    av_x = jnp.sqrt(_sum(x * x) / 32)
    scales, mins, codes = _scale_and_min(x, av_x[..., None] + jnp.abs(x), 15, -1.0, 0.1, 20)
    max_scale = jnp.maximum(scales.max(-1), 0.0)
    max_min = jnp.maximum(mins.max(-1), 0.0)
    inv_scale = jnp.where(max_scale > 0, 63 / jnp.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_min = jnp.where(max_min > 0, 63 / jnp.where(max_min > 0, max_min, 1.0), 0.0)
    # a division: XLA makes one by a broadcast scalar a product with its reciprocal, which rounds differently
    sixty_three = jax.lax.optimization_barrier(jnp.full(max_scale.shape, 63, jnp.float32))
    step = _f16(max_scale / sixty_three)[..., None] * _six_bits(inv_scale[..., None] * scales)
    offset = _f16(max_min / sixty_three)[..., None] * _six_bits(inv_min[..., None] * mins)
    requant = jnp.clip(jnp.round((x + offset[..., None]) / jnp.where(step == 0, 1.0, step)[..., None]), 0, 15)
    codes = jnp.where((step != 0)[..., None], requant, codes)
    return (step[..., None] * codes - offset[..., None]).reshape(w.shape)


def round_trip_q4_k_m(w: jax.Array) -> jax.Array:
    """A LoRA projection's weight as a Q4_K_M export stores it: q4_K, or q5_0 where a row is not whole
    super-blocks (the export's fallback)."""
    return round_trip_q4_k(w) if w.shape[-1] % QK_K == 0 else round_trip_q4_0(w, half=16)  # q5_0
