"""Cross-entropy over the vocabulary in chunks of tokens, with its gradient computed in the same pass.

[tokens, vocab] float32 logits never exist whole, and the logits GEMM runs once: each chunk's forward pass
also forms d loss / d logits = softmax - onehot (float32, then cast to the head's dtype) and multiplies it by
the head, so the backward pass only scales that stored [tokens, hidden] gradient. Two vocabulary-sized GEMMs
per chunk (logits, hidden gradient) in the head's dtype with float32 accumulation, instead of three
(logits, recomputed logits, a float32 hidden gradient) for a checkpointed chunk under autodiff.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtune.data.packing import IGNORE
from jaxtune.ops import dot_out
from jaxtune.parallel.sharding import batch_shards, current_mesh


def chunked_cross_entropy(
    hidden: jax.Array, head: jax.Array, labels: jax.Array, *, chunk_size: int = 1024, softcap: float | None = None
) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses, number of label tokens) for hidden [..., T, H], head [V, H], labels [..., T].

    Logits are computed about `chunk_size` tokens (per device) at a time, in float32 from operands in the
    head's dtype. Chunks run along T with every row in each, so a batch split over devices stays split (each
    device computes the loss of its own rows). Differentiable in `hidden` and `head`; the head's gradient
    (a [V, H] float32 accumulator) is formed only when something differentiates the head. `softcap`: the logits are
    soft-capped to c * tanh(logits / c) first (Gemma), their gradient through the cap.
    """
    h = hidden.reshape(-1, *hidden.shape[-2:])
    y = labels.reshape(-1, labels.shape[-1])
    rows, t, width = h.shape
    mesh = current_mesh()
    shards = 1 if mesh is None or rows % batch_shards(mesh) else batch_shards(mesh)
    steps = max(1, min(t, chunk_size * shards // rows))
    pad = (-t) % steps
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).astype(head.dtype)
    y = jnp.pad(y, ((0, 0), (0, pad)), constant_values=IGNORE)
    n = (t + pad) // steps
    total = _fused_cross_entropy(h.reshape(rows, n, steps, width).swapaxes(0, 1), head,
                                 y.reshape(rows, n, steps).swapaxes(0, 1), softcap)
    return total, jnp.sum(labels != IGNORE)


def chunked_token_logps(hidden: jax.Array, head: jax.Array, labels: jax.Array, *, chunk_size: int = 1024,
                        softcap: float | None = None, temperature: float = 1.0) -> jax.Array:
    """log p(label) of every token [..., T] (0 where the label is IGNORE), for hidden [..., T, H], head [V, H].

    The sequence-level losses of preference tuning weight each token's log-probability differently, so this
    returns them one by one; chunking and the fused gradient are those of `chunked_cross_entropy` (each
    token's d logp / d hidden is formed in the forward pass and scaled by its own cotangent in the backward).
    """
    return chunked_token_logps_and_entropy(hidden, head, labels, chunk_size=chunk_size, softcap=softcap,
                                           temperature=temperature)[0]


def chunked_token_logps_and_entropy(hidden: jax.Array, head: jax.Array, labels: jax.Array, *,
                                    chunk_size: int = 1024, softcap: float | None = None,
                                    temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(log p(label), the entropy of the predicted distribution) of every token [..., T], both 0 where the label
    is IGNORE; the entropy (RL's exploration metric) is computed from the same chunk's logits, undifferentiated,
    and costs nothing where unused (dead code to XLA). `temperature`: the distribution of the (soft-capped) logits
    divided by it, as a sampler at that temperature draws from."""
    h = hidden.reshape(-1, *hidden.shape[-2:])
    y = labels.reshape(-1, labels.shape[-1])
    rows, t, width = h.shape
    mesh = current_mesh()
    shards = 1 if mesh is None or rows % batch_shards(mesh) else batch_shards(mesh)
    steps = max(1, min(t, chunk_size * shards // rows))
    pad = (-t) % steps
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).astype(head.dtype)
    y = jnp.pad(y, ((0, 0), (0, pad)), constant_values=IGNORE)
    n = (t + pad) // steps
    per_chunk = _fused_token_logps(h.reshape(rows, n, steps, width).swapaxes(0, 1), head,
                                   y.reshape(rows, n, steps).swapaxes(0, 1), softcap, float(temperature))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(rows, t + pad)[:, :t].reshape(labels.shape)  # noqa: E731
    return unchunk(per_chunk[0]), jax.lax.stop_gradient(unchunk(per_chunk[1]))


def _token_terms(h_c: jax.Array, head: jax.Array, y_c: jax.Array, softcap: float | None, entropy: bool = False,
                 temperature: float = 1.0):
    """(token losses -log p(label) [rows, steps], d loss / d logits in the head's dtype) of one chunk; both zero
    where the label is IGNORE. With `entropy`, a third: each token's predictive entropy (0 where IGNORE). The
    logits are soft-capped, then divided by `temperature`; the gradient is with respect to the head's product."""
    logits = jax.lax.dot_general(h_c, head, (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    slope = None  # d(final logits) / d(head's product), where it is not 1
    if softcap is not None:
        capped = jnp.tanh(logits / softcap)
        logits, slope = softcap * capped, 1.0 - capped * capped
    if temperature != 1.0:
        logits = logits / temperature
        slope = (1.0 if slope is None else slope) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    valid = y_c != IGNORE
    target = jnp.where(valid, y_c, 0)
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    nll = jnp.where(valid, lse - picked, 0.0)
    probs = jnp.exp(logits - lse[..., None])
    onehot = jax.nn.one_hot(target, logits.shape[-1], dtype=jnp.float32)
    dlogits = jnp.where(valid[..., None], probs - onehot, 0.0)
    dlogits = (dlogits if slope is None else dlogits * slope).astype(head.dtype)
    if entropy:
        return nll, dlogits, jnp.where(valid, lse - jnp.sum(probs * logits, axis=-1), 0.0)
    return nll, dlogits


def _chunk(h_c: jax.Array, head: jax.Array, y_c: jax.Array, head_grad: bool, softcap: float | None):
    """Loss sum, d loss / d h_c and (if asked) d loss / d head of one chunk h_c [rows, steps, H]."""
    nll, dlogits = _token_terms(h_c, head, y_c, softcap)
    dh = dot_out(dlogits, head, (((2,), (0,)), ((), ())), h_c.dtype)
    dhead = None
    if head_grad:
        dhead = jax.lax.dot_general(dlogits, h_c, (((0, 1), (0, 1)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.sum(nll), dh, dhead


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_cross_entropy(h: jax.Array, head: jax.Array, y: jax.Array, softcap: float | None) -> jax.Array:
    """Sum of token losses over chunks h [n, rows, steps, H], y [n, rows, steps]."""
    def body(total, xs):
        loss, _, _ = _chunk(xs[0], head, xs[1], False, softcap)  # the unused gradient is dead code to XLA
        return total + loss, None

    total, _ = jax.lax.scan(body, jnp.float32(0), (h, y))
    return total


def _fused_fwd(h, head, y, softcap):
    head_grad = head.perturbed
    h, head, y = h.value, head.value, y.value

    def body(carry, xs):
        total, dhead = carry
        loss, dh, dhead_c = _chunk(xs[0], head, xs[1], head_grad, softcap)
        return (total + loss, dhead + dhead_c if head_grad else dhead), dh

    dhead0 = jnp.zeros(head.shape, jnp.float32) if head_grad else jnp.zeros((), jnp.float32)
    (total, dhead), dh = jax.lax.scan(body, (jnp.float32(0), dhead0), (h, y))
    return total, (dh, dhead.astype(head.dtype) if head_grad else None)


def _fused_bwd(softcap, res, g):
    dh, dhead = res
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros_like(dh), None if dhead is None else jnp.zeros_like(dhead), None
    scale = lambda x: (x.astype(jnp.float32) * g).astype(x.dtype)  # noqa: E731
    return scale(dh), None if dhead is None else scale(dhead), None


_fused_cross_entropy.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_token_logps(h: jax.Array, head: jax.Array, y: jax.Array, softcap: float | None, temperature: float
                       ) -> tuple[jax.Array, jax.Array]:
    """(token log-probabilities, entropies) [n, rows, steps] each over chunks h [n, rows, steps, H], y [n, rows,
    steps]; the entropies carry no gradient."""
    def body(_, xs):
        nll, _, ent = _token_terms(xs[0], head, xs[1], softcap, True, temperature)
        return None, (-nll, ent)

    return jax.lax.scan(body, None, (h, y))[1]


def _token_logps_fwd(h, head, y, softcap, temperature):
    head_grad = head.perturbed
    h, head, y = h.value, head.value, y.value

    def body(_, xs):
        nll, dlogits, ent = _token_terms(xs[0], head, xs[1], softcap, True, temperature)
        return None, (-nll, ent, dot_out(dlogits, head, (((2,), (0,)), ((), ())), xs[0].dtype))

    _, (logps, entropies, dnll_dh) = jax.lax.scan(body, None, (h, y))
    # d logp / d head needs each token's cotangent, known only in the backward pass: keep what recomputes it
    return (logps, entropies), (dnll_dh, (h, head, y) if head_grad else None)


def _token_logps_bwd(softcap, temperature, res, gs):
    dnll_dh, recompute = res
    g = gs[0]  # the entropies' cotangent is ignored: they are a metric
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros_like(dnll_dh), None if recompute is None else jnp.zeros_like(recompute[1]), None
    g = g.astype(jnp.float32)
    dh = (-dnll_dh.astype(jnp.float32) * g[..., None]).astype(dnll_dh.dtype)
    if recompute is None:
        return dh, None, None
    h, head, y = recompute

    def body(acc, xs):
        h_c, y_c, g_c = xs
        _, dlogits = _token_terms(h_c, head, y_c, softcap, False, temperature)
        weighted = (-dlogits.astype(jnp.float32) * g_c[..., None]).astype(head.dtype)
        return acc + jax.lax.dot_general(weighted, h_c, (((0, 1), (0, 1)), ((), ())),
                                         preferred_element_type=jnp.float32), None

    dhead, _ = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32), (h, y, g))
    return dh, dhead.astype(head.dtype), None


_fused_token_logps.defvjp(_token_logps_fwd, _token_logps_bwd, symbolic_zeros=True)
