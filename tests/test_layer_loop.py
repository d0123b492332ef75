"""The decoder layers' loop with its own VJP against JAX's own differentiation of the same layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtune.models.layer_loop import layer_loop
from test_kernel_dispatch import all_eqns

LAYERS = 3


def _layer(h, params, invariant, index):
    """A layer reading a loop constant at its index (like the whole-stack NF4 codes), a per-layer key (dropout)
    and a named value (what selective remat keeps)."""
    table, scale = invariant
    mask = jax.random.bernoulli(params["key"], 0.8, h.shape)
    mid = jax.ad_checkpoint.checkpoint_name(jnp.tanh(h @ params["w"] + (h @ params["a"]) @ params["b"]), "mid")
    return jnp.where(mask, mid * scale + h @ table[index], 0.0) + h


def _inputs(seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 6)
    params = {"w": 0.3 * jax.random.normal(k[0], (LAYERS, 16, 16)), "a": 0.3 * jax.random.normal(k[1], (LAYERS, 16, 4)),
              "b": 0.3 * jax.random.normal(k[2], (LAYERS, 4, 16)), "key": jax.random.split(k[3], LAYERS)}
    invariant = (0.2 * jax.random.normal(k[4], (LAYERS, 16, 16)), jnp.float32(1.5))
    return jax.random.normal(k[5], (5, 16)), params, invariant


def _unrolled(h, params, invariant):
    for i in range(LAYERS):
        h = _layer(h, jax.tree.map(lambda a: a[i], params), invariant, i)
    return h


@pytest.mark.parametrize("unrolled", [False, True], ids=["loop", "unrolled"])
@pytest.mark.parametrize("policy", [None, "nothing", "mid"])
def test_gradients_match_autodiff_of_the_unrolled_layers(policy, unrolled):
    h, params, invariant = _inputs()
    policies = {"nothing": jax.checkpoint_policies.nothing_saveable,
                "mid": jax.checkpoint_policies.save_only_these_names("mid")}
    layer = _layer if policy is None else jax.checkpoint(_layer, policy=policies[policy], prevent_cse=unrolled)
    trained = {k: v for k, v in params.items() if k != "b"}  # "b" frozen: it gets no gradient

    def loss(fn, h, trained):
        out = fn(h, {**trained, "b": params["b"]}, invariant)
        return jnp.sum(jnp.sin(out) * out)

    looped = lambda h, p, inv: layer_loop(layer, h, p, inv, LAYERS, unrolled=unrolled)  # noqa: E731
    float_part = lambda t: {k: v for k, v in t.items() if k != "key"}  # noqa: E731
    want = jax.grad(lambda h, t: loss(_unrolled, h, {**t, "key": params["key"]}), argnums=(0, 1))(
        h, float_part(trained))
    got = jax.jit(jax.grad(lambda h, t: loss(looped, h, {**t, "key": params["key"]}), argnums=(0, 1)))(
        h, float_part(trained))
    np.testing.assert_allclose(np.asarray(loss(looped, h, trained)), np.asarray(loss(_unrolled, h, trained)),
                               rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


def test_residual_stacks_are_allocated_uninitialized_and_loop_constants_are_not_stacked():
    h, params, invariant = _inputs()

    def loss(w):
        return jnp.sum(layer_loop(_layer, h, {**params, "w": w}, invariant, LAYERS) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(params["w"]).jaxpr
    stacks = [e for e in jaxpr.eqns if e.primitive.name == "empty"]
    assert stacks and all(e.outvars[0].aval.shape[0] == LAYERS for e in stacks)
    # the table is read at each layer's index: its slices are per-layer residuals (16 x 16 each), but the
    # table itself ([LAYERS, 16, 16] as a whole) is never stacked again per layer
    assert not any(e.outvars[0].aval.shape == (LAYERS, LAYERS, 16, 16) for e in stacks)
    fwd_loop = next(e for e in jaxpr.eqns if e.primitive.name == "scan" and not e.params["reverse"])
    assert not any(e.primitive.name == "broadcast_in_dim" and e.outvars[0].aval.shape[:1] == (LAYERS,)
                   for e in jaxpr.eqns[:jaxpr.eqns.index(fwd_loop)])


def test_differentiating_a_loop_constant_is_refused():
    h, params, (table, scale) = _inputs()
    with pytest.raises(NotImplementedError, match="loop constants"):
        jax.grad(lambda s: jnp.sum(layer_loop(_layer, h, params, (table, s), LAYERS)))(scale)


def test_an_output_outside_the_loss_gives_zero_gradients_through_the_loop():
    h, params, invariant = _inputs()

    def loss(w):
        out = layer_loop(_layer, h, {**params, "w": w}, invariant, LAYERS)
        return jnp.sum(jax.lax.stop_gradient(out)) + jnp.sum(w ** 2)

    np.testing.assert_allclose(np.asarray(jax.grad(loss)(params["w"])), 2 * np.asarray(params["w"]), rtol=1e-6)


def test_unrolled_layers_keep_residuals_without_stacks():
    """Unrolled, each layer's saved values are buffers of their own: no stack is allocated, written or sliced
    (the only slices left are each layer's read of the loop constant at its index, as in the loop)."""
    h, params, invariant = _inputs()
    layer = jax.checkpoint(_layer, policy=jax.checkpoint_policies.save_only_these_names("mid"), prevent_cse=True)

    def stack_work(unrolled: bool) -> set[str]:
        loss = lambda w: jnp.sum(layer_loop(layer, h, {**params, "w": w}, invariant, LAYERS, unrolled=unrolled) ** 2)  # noqa: E731
        eqns = all_eqns(jax.make_jaxpr(jax.grad(loss))(params["w"]).jaxpr)
        table_read = lambda e: e.primitive.name == "dynamic_slice" and e.invars[0].aval.shape == invariant[0].shape  # noqa: E731
        return {e.primitive.name for e in eqns if e.primitive.name in STACK_WORK and not table_read(e)}

    STACK_WORK = {"empty", "scan", "dynamic_update_slice", "dynamic_slice"}
    # the loop's stacks, as a contrast (the check sees them): filled in place, read as the scan's slices
    assert stack_work(False) == {"empty", "scan", "dynamic_update_slice"}
    assert stack_work(True) == set()

