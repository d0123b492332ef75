"""What a rollout's decoding costs at the least: every step reads the weights and the cache once, so a step takes
at least (weight bytes + cache bytes) / the device's memory bandwidth. A rollout's fraction of that bound is what
its metrics report."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune.models.cache import KVCache
from jaxtune.quant.weights import QuantizedWeight

# peak HBM / GDDR bandwidth in bytes per second by the device kind jax reports (NVIDIA's data sheets)
_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12), ("GH200", 4.0e12),
              ("B200", 8.0e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12),
              ("L40S", 0.864e12), ("L4", 0.3e12), ("A10G", 0.6e12), ("RTX 4090", 1.008e12), ("RTX 3090", 0.936e12))


def memory_bandwidth(device: jax.Device | None = None) -> float | None:
    """Peak memory bandwidth (bytes/s) of `device` (the first one by default); None where it is not known (CPUs,
    unlisted cards)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return None
    kind = device.device_kind
    return next((bw for name, bw in _BANDWIDTH if name in kind), None)


def weight_bytes(frozen, lora, dtype: jnp.dtype, dense_fraction: float = 0.0) -> int:
    """Bytes of weights one decoding step reads: the 4-bit codes and their scales (the share `dense_fraction` of
    them as their dequantized copy in `dtype`), the adapters, norms and the head; the input embedding's table is
    not counted where the head is another array (a step gathers a row of it)."""
    quantized = other = codes = embed = 0
    head_is_embed = True
    for path, var in nnx.to_flat_state(frozen):
        nbytes = int(np.prod(var.value.shape)) * var.value.dtype.itemsize
        head_is_embed &= "lm_head" not in map(str, path)
        if isinstance(var, QuantizedWeight):
            quantized += nbytes
            codes += nbytes if str(path[-1]) == "codes" else 0  # the 4-bit values, two a byte
        elif any(str(k).startswith("embed_tokens") for k in path):  # the per-layer inputs' tables too
            embed += nbytes
        else:
            other += nbytes
    other += embed if head_is_embed else 0
    adapters = sum(int(np.prod(v.value.shape)) * v.value.dtype.itemsize for _, v in nnx.to_flat_state(lora))
    dense = 2 * codes * jnp.dtype(dtype).itemsize  # two 4-bit codes per byte
    return int((1 - dense_fraction) * quantized + dense_fraction * dense + other + adapters)


def cache_bytes(cfg, rows: int, cache_len: int, dtype: jnp.dtype, per_layer: bool) -> int:
    """Bytes of the decoding cache of `rows` rows of `cache_len` entries (the attention reads all of it each step):
    KV entries, segment ids, and a hybrid decoder's windows and states."""
    shapes = jax.eval_shape(lambda: KVCache.empty(cfg, rows, cache_len, dtype, per_layer=per_layer))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(shapes))


def step_bytes(frozen, lora, cfg, dtype: jnp.dtype, rows: int, cache_len: int, per_layer: bool,
               dense_fraction: float = 0.0) -> int:
    """Bytes one decoding step of `rows` rows reads: `weight_bytes` and `cache_bytes`."""
    return weight_bytes(frozen, lora, dtype, dense_fraction) + cache_bytes(cfg, rows, cache_len, dtype, per_layer)


def bound_seconds(steps: int, step_bytes: int, bandwidth: float) -> float:
    """The least time `steps` decoding steps of `step_bytes` each take at `bandwidth`."""
    return steps * step_bytes / bandwidth
