"""Dense matmuls of the model (embeddings' head, LoRA factors, unquantized projections) in XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def dot_out(a: jax.Array, b: jax.Array, dims, out_dtype: jnp.dtype) -> jax.Array:
    """dot_general with f32 accumulation, written in `out_dtype`.

    On GPU a 16-bit result comes straight out of the GEMM (cuBLAS and XLA's GEMM fusions accumulate in f32
    and round once at the end): asking for an f32 result there makes XLA write the [tokens, out] product in
    f32 and convert it in a separate pass. Elsewhere the product is formed in f32 and rounded."""
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype.itemsize == 2 and jax.default_backend() == "gpu":
        return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def linear(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """y = x @ weight.T (+ bias) for an HF-layout weight [out, in]; f32 accumulation, x's dtype out."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if bias is None:
        return dot_out(x, weight.astype(x.dtype), dims, out_dtype or x.dtype)
    y = jax.lax.dot_general(x, weight.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return (y + bias.astype(jnp.float32)).astype(out_dtype or x.dtype)


def input_gradient(dy: jax.Array, w: jax.Array) -> jax.Array:
    """dx = dy @ w for a weight [out, in]: the input gradient of `linear`, in dy's dtype."""
    return dot_out(dy, w, (((dy.ndim - 1,), (0,)), ((), ())), dy.dtype)


def zero_cotangent(a: jax.Array) -> jax.Array:
    """The cotangent of a frozen array: float0 for integer arrays (NF4 codes), zeros otherwise."""
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, dtype=jax.dtypes.float0)
    return jnp.zeros_like(a)


def rows(a: jax.Array) -> int:
    """The number of rows (tokens) of an activation [..., features]."""
    return int(np.prod(a.shape[:-1]))
