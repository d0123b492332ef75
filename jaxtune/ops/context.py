"""Trace-time context the model sets around its layers: which layer of a stacked scan runs, in which
precision the frozen projections compute, whether their weights are dequantized at use, and whether segment ids
carry shared prefixes."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

COMPUTE_MODES = ("bf16", "fp8")
# and, inside the model only: "fp8-dx", the forward in the model's dtype and the input gradient in FP8
INNER_COMPUTE_MODES = ("fp8-dx",)

_stacked_layer: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("stacked_layer", default=None)
_frozen_compute: contextvars.ContextVar[str] = contextvars.ContextVar("frozen_compute", default="bf16")
# (input, its FP8 rows and scales) quantized within the current "fp8" block, so projections that read one input
# (gate and up, q/k/v) quantize it once
_fp8_inputs: contextvars.ContextVar[list | None] = contextvars.ContextVar("fp8_inputs", default=None)
_shared_prefix: contextvars.ContextVar[bool] = contextvars.ContextVar("shared_prefix", default=False)
_at_use: contextvars.ContextVar[bool] = contextvars.ContextVar("dequantize_at_use", default=False)
_fake_quantized: contextvars.ContextVar[str | None] = contextvars.ContextVar("fake_quantized", default=None)
_static_layer: contextvars.ContextVar[int | None] = contextvars.ContextVar("static_layer", default=None)
_ring_cache: contextvars.ContextVar[bool] = contextvars.ContextVar("ring_cache", default=False)


@contextlib.contextmanager
def _set_within(var: contextvars.ContextVar, value) -> Iterator[None]:
    """`var` holds `value` within the block, its previous value after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def stacked_layer(index: jax.Array) -> contextlib.AbstractContextManager[None]:
    """Within the block (a layer scan's body), NF4 weights whose codes are the whole stack are layer `index`."""
    return _set_within(_stacked_layer, index)


def stacked_layer_index() -> jax.Array | None:
    return _stacked_layer.get()


def static_layer(index: int) -> contextlib.AbstractContextManager[None]:
    """Within the block, the decoder layer traced is layer `index`, a Python int (one traced layer per decoder
    layer): what picks a layer's own array from a tuple of per-layer arrays."""
    return _set_within(_static_layer, index)


def static_layer_index() -> int | None:
    return _static_layer.get()


@contextlib.contextmanager
def frozen_compute(mode: str) -> Iterator[None]:
    """Within the block, NF4 projections traced compute in `mode`: "bf16" (the model's dtype), "fp8", or
    "fp8-dx" (the forward in the model's dtype, the input gradient in FP8)."""
    if mode not in COMPUTE_MODES + INNER_COMPUTE_MODES:
        raise ValueError(f"unknown compute mode {mode!r}; use one of {', '.join(COMPUTE_MODES)}")
    token = _frozen_compute.set(mode)
    inputs = _fp8_inputs.set([]) if mode == "fp8" else None
    try:
        yield
    finally:
        _frozen_compute.reset(token)
        if inputs is not None:
            _fp8_inputs.reset(inputs)


def fake_quantized(fmt: str | None) -> contextlib.AbstractContextManager[None]:
    """Within the block, LoRA projections traced use their merged weight through `fmt`'s quantizer (QAT;
    `jaxtune.quant.fake`); None: the usual base + LoRA path."""
    return _set_within(_fake_quantized, fmt)


def fake_quantize_format() -> str | None:
    """The format `fake_quantized` set for what is traced now (None outside any block)."""
    return _fake_quantized.get()


def frozen_compute_mode() -> str:
    """The mode `frozen_compute` set for what is traced now ("bf16" outside any block)."""
    return _frozen_compute.get()


def fp8_inputs_seen() -> list | None:
    """The (input, quantized) pairs of the current "fp8" block (None outside one): `fp8_linear`'s memo."""
    return _fp8_inputs.get()


def shared_prefix_segments() -> contextlib.AbstractContextManager[None]:
    """Within the block, a negative segment id -2p or -2p-1 marks a branch that also attends to the run of id p
    before it (a preference pair's prompt, run once for both responses); see `pallas_kernels.attention_segments`."""
    return _set_within(_shared_prefix, True)


def segments_share_prefixes() -> bool:
    return _shared_prefix.get()


def ring_kv_cache() -> contextlib.AbstractContextManager[None]:
    """Within the block, a KV cache is a ring: a decoding step's token sits at cache index `q_offset` and the
    entries before it in time wrap around the end, so every entry the segment ids leave visible is in its past,
    and an entry's distance is (q_offset - index) mod the cache's length (continuous batching's slots,
    `jaxtune.rl.continuous`)."""
    return _set_within(_ring_cache, True)


def kv_cache_is_ring() -> bool:
    return _ring_cache.get()


def dequantize_at_use(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """Within the block, a frozen projection dequantizes its weight only once its input (forward) or output
    gradient (backward) exists, and the backward pass dequantizes again rather than keep the forward's copy: one
    dequantized weight alive at a time instead of a layer's worth (memory-first training: per-layer recompute and
    offload), for one more dequantization per projection in the backward pass."""
    return _set_within(_at_use, on)


def dequantizing_at_use() -> bool:
    return _at_use.get()


def barrier(on: bool, *arrays):
    """`arrays` as they are, or (`on`) through one optimization barrier, so that what is computed from them
    afterwards waits for all of them and is not merged with the same computation on the unbarriered arrays."""
    return jax.lax.optimization_barrier(arrays) if on else arrays
