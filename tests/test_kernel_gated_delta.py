"""The Pallas chunked gated delta rule (pallas_kernels/gated_delta.py) in interpret mode: its outputs and final
state against the float64 token-by-token recurrence in numpy, its gradients (every input, the carried state
included) against autodiff of the XLA chunked form, on ragged lengths, packed segments, grouped heads and a carried
state; and its forward and backward lowered for CUDA at Qwen3.5's head dims."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.ops import dispatch
from jaxtune.ops.gated_delta import gated_delta_rule_chunked
from pallas_kernels import gated_delta as gd
from pallas_kernels.gated_delta import gated_delta_reference, gated_delta_rule_pallas
from test_gated_delta import inputs, segments

CASES = [  # b, t, hk, hv, dk, dv, packed, carried state, chunk
    (2, 150, 2, 4, 16, 32, True, False, 64),   # packed segments across chunk edges, padding, grouped heads
    (2, 37, 1, 2, 32, 16, False, True, 16),    # ragged, a carried state (prefill after earlier tokens)
]


@pytest.mark.parametrize("b, t, hk, hv, dk, dv, packed, carried, chunk", CASES)
def test_the_kernel_equals_the_float64_recurrence(b, t, hk, hv, dk, dv, packed, carried, chunk):
    q, k, v, g, beta = inputs(b, t, hk, hv, dk, dv, seed=t)
    ids = segments(b, t, seed=t) if packed else None
    state = np.random.default_rng(1).standard_normal((b, hv, dk, dv)).astype(np.float32) if carried else None
    want, want_state = gated_delta_reference(q, k, v, g, beta, ids, state)
    with jax.default_matmul_precision("highest"):
        got, got_state = gated_delta_rule_pallas(
            q, k, v, g, beta, segment_ids=None if ids is None else jnp.asarray(ids),
            initial_state=None if state is None else jnp.asarray(state), chunk=chunk, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    if not packed:  # a packed row's final state is its last segment's (padding's, here)
        np.testing.assert_allclose(np.asarray(got_state), want_state, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dk, dv, block", [(16, 16, 64), (32, 32, 16)])
def test_the_kernels_gradients_equal_the_xla_forms(dk, dv, block, monkeypatch):
    """block < the head dims: the backward's kernels loop over key and value column blocks, and the key blocks'
    shares of the per-token factors' gradients are summed after."""
    monkeypatch.setattr(gd, "BLOCK_K", block)
    monkeypatch.setattr(gd, "BLOCK_V", block)
    b, t, hk, hv = 2, 90, 1, 2
    q, k, v, g, beta = inputs(b, t, hk, hv, dk, dv, seed=5)
    ids = jnp.asarray(segments(b, t, seed=5))
    state = jnp.asarray(np.random.default_rng(2).standard_normal((b, hv, dk, dv)).astype(np.float32))
    w = jax.random.normal(jax.random.key(0), (b, t, hv, dv))
    ws = jax.random.normal(jax.random.key(1), (b, hv, dk, dv))

    def loss(rule, *args):
        out, final = rule(*args[:5], segment_ids=ids, initial_state=args[5])
        return jnp.sum(out * w) + jnp.sum(final * ws)

    argnums = tuple(range(6))
    with jax.default_matmul_precision("highest"):
        want = jax.grad(lambda *a: loss(lambda *x, **kw: gated_delta_rule_chunked(*x, chunk=32, **kw), *a),
                        argnums=argnums)(q, k, v, g, beta, state)
        got = jax.grad(lambda *a: loss(lambda *x, **kw: gated_delta_rule_pallas(*x, chunk=32, interpret=True, **kw),
                                       *a), argnums=argnums)(q, k, v, g, beta, state)
    for a, b_ in zip(got, want):
        scale = np.abs(np.asarray(b_)).max()
        assert scale > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b_), rtol=1e-4, atol=1e-5 * scale)


def test_the_kernel_lowers_for_cuda_forward_and_backward(cuda_export):
    b, t, hk, hv, d = 1, 200, 2, 4, 128  # ragged length; Qwen3.5's head dims

    def step(q, k, v, g, beta, ids):
        def loss(*a):
            out, final = gated_delta_rule_pallas(*a, segment_ids=ids)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

    shape = jax.ShapeDtypeStruct
    text = cuda_export(step, shape((b, t, hk, d), jnp.bfloat16), shape((b, t, hk, d), jnp.bfloat16),
                       shape((b, t, hv, d), jnp.bfloat16), shape((b, t, hv), jnp.float32),
                       shape((b, t, hv), jnp.float32), shape((b, t), jnp.int32))
    for kernel in ("gated_delta_wy", "gated_delta_states", "gated_delta_output", "gated_delta_state_grads",
                   "gated_delta_chunk_grads_qk", "gated_delta_chunk_grads_wy"):
        assert kernel in text


def test_the_model_picks_the_kernel_where_it_applies(monkeypatch):
    monkeypatch.setattr(dispatch, "_mode", None)
    monkeypatch.setenv(dispatch.ENV_VAR, "pallas")
    assert dispatch.gated_delta_impl(128, 128) == "pallas"
    assert dispatch.gated_delta_impl(128, 96) == "xla"  # not a power of two: the XLA path
    monkeypatch.setenv(dispatch.ENV_VAR, "xla")
    assert dispatch.gated_delta_impl(128, 128) == "xla"
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert dispatch.gated_delta_impl(128, 128) == ("pallas" if jax.default_backend() == "gpu" else "xla")
