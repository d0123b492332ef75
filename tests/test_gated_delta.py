"""The gated delta rule against a float64 token-by-token recurrence written in numpy: the XLA recurrence and the
chunked (WY) form, on ragged lengths, packed segments, grouped heads and a carried state; gradients of the chunked
form equal the recurrence's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.ops.gated_delta import gated_delta_rule_chunked, gated_delta_rule_recurrent
from pallas_kernels.gated_delta import gated_delta_reference as reference


def inputs(b, t, hk, hv, dk, dv, seed):
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((b, t, hk, dk)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))  # the layer L2-normalises them
    v = rng.standard_normal((b, t, hv, dv)).astype(np.float32)
    g = -np.exp(rng.normal(-1.5, 1.0, (b, t, hv))).astype(np.float32)  # log decays <= 0, some steep
    beta = 1 / (1 + np.exp(-rng.standard_normal((b, t, hv)))).astype(np.float32)
    return q, k, v, g, beta


def segments(b, t, seed):
    """Packed rows: segments of ragged lengths, padding (id 0) at the end of some rows."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((b, t), np.int32)
    for r in range(b):
        pos, sid = 0, 1
        while pos < t - (r % 2) * 5:
            n = int(rng.integers(1, 40))
            ids[r, pos:pos + n] = sid
            pos, sid = pos + n, sid + 1
        ids[r, t - (r % 2) * 5:] = 0
    return ids


CASES = [  # b, t, hk, hv, dk, dv, packed, carried state, chunk
    (2, 64, 2, 2, 16, 16, False, False, 64),
    (1, 100, 1, 2, 8, 12, False, False, 32),   # ragged: padded to whole chunks; grouped value heads
    (2, 150, 2, 4, 16, 8, True, False, 64),    # packed segments across chunk edges, padding
    (2, 37, 1, 1, 32, 16, False, True, 16),    # a carried state (prefill after earlier tokens)
]


@pytest.mark.parametrize("state_pass", ["scan", "associative"])
@pytest.mark.parametrize("b, t, hk, hv, dk, dv, packed, carried, chunk", CASES)
def test_both_forms_equal_the_float64_recurrence(b, t, hk, hv, dk, dv, packed, carried, chunk, state_pass):
    q, k, v, g, beta = inputs(b, t, hk, hv, dk, dv, seed=t)
    ids = segments(b, t, seed=t) if packed else None
    state = np.random.default_rng(1).standard_normal((b, hv, dk, dv)).astype(np.float32) if carried else None
    want, want_state = reference(q, k, v, g, beta, ids, state)
    kw = dict(segment_ids=None if ids is None else jnp.asarray(ids),
              initial_state=None if state is None else jnp.asarray(state))
    with jax.default_matmul_precision("highest"):
        rec, rec_state = gated_delta_rule_recurrent(q, k, v, g, beta, **kw)
        chunked, chunked_state = gated_delta_rule_chunked(q, k, v, g, beta, chunk=chunk, state_pass=state_pass, **kw)
    for got, got_state in ((rec, rec_state), (chunked, chunked_state)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
        if not packed:  # a packed row's final state is its last segment's (padding's, here)
            np.testing.assert_allclose(np.asarray(got_state), want_state, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("state_pass", ["scan", "associative"])
def test_the_chunked_forms_gradients_equal_the_recurrences(state_pass):
    q, k, v, g, beta = inputs(2, 90, 1, 2, 8, 8, seed=5)
    ids = jnp.asarray(segments(2, 90, seed=5))
    w = jax.random.normal(jax.random.key(0), (2, 90, 2, 8))

    def loss(fn, *args):
        return jnp.sum(fn(*args, segment_ids=ids)[0] * w)

    with jax.default_matmul_precision("highest"):
        want = jax.grad(lambda *a: loss(gated_delta_rule_recurrent, *a), argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
        got = jax.grad(lambda *a: loss(lambda *x, **kw: gated_delta_rule_chunked(*x, chunk=32, state_pass=state_pass,
                                                                                 **kw), *a),
                       argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
    for a, b_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-3, atol=1e-4)
        assert np.isfinite(np.asarray(a)).all()
