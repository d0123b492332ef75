"""One GEMM over all experts: rows grouped by expert times each group's own weight (`jax.lax.ragged_dot`).

Dropless: every routed row is computed, however uneven the groups (empty ones included), with no capacity
factor, no Python loop over experts and no dense all-experts product."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(x: jax.Array, weight: jax.Array, group_sizes: jax.Array, *,
                   out_dtype: jnp.dtype | None = None) -> jax.Array:
    """y[rows of group e] = x[rows of group e] @ weight[e].T for HF-layout expert weights [E, out, in].

    x [M, in] holds its rows sorted by group (group e's `group_sizes[e]` rows after group e-1's); rows past
    sum(group_sizes) come out as zeros. float32 accumulation, x's dtype (or `out_dtype`) out."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    y = jax.lax.ragged_dot_general(x, weight.astype(x.dtype), group_sizes.astype(jnp.int32), dims,
                                   preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)


def grouped_matmul_reference(x, weight, group_sizes):
    """The same product as a loop over groups (numpy float64): what the tests hold `grouped_matmul` to."""
    import numpy as np

    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    y, start = np.zeros((x.shape[0], weight.shape[1])), 0
    for e, n in enumerate(np.asarray(group_sizes)):
        y[start:start + n] = x[start:start + n] @ weight[e].T
        start += n
    return y
