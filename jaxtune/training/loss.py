"""Cross-entropy over the vocabulary in chunks of tokens: [tokens, vocab] float32 logits never exist whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.data.packing import IGNORE


def chunked_cross_entropy(
    hidden: jax.Array, head: jax.Array, labels: jax.Array, *, chunk_size: int = 1024
) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses, number of label tokens) for hidden [..., H], head [V, H], labels [...].

    Logits are computed chunk by chunk in float32 and recomputed in the backward pass (jax.checkpoint),
    so peak memory holds one [chunk_size, V] block instead of [tokens, V].
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    n = h.shape[0]
    chunk = min(chunk_size, n)
    pad = (-n) % chunk
    h = jnp.pad(h, ((0, pad), (0, 0)))
    y = jnp.pad(y, (0, pad), constant_values=IGNORE)

    @jax.checkpoint
    def chunk_loss(h_c, y_c):
        logits = jax.lax.dot_general(h_c, head.astype(h_c.dtype), (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        valid = y_c != IGNORE
        target = jnp.take_along_axis(logits, jnp.where(valid, y_c, 0)[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(valid, lse - target, 0.0))

    def body(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(body, jnp.float32(0), (h.reshape(-1, chunk, h.shape[-1]), y.reshape(-1, chunk)))
    return total, jnp.sum(labels != IGNORE)
