"""Cross-entropy over the vocabulary in chunks of tokens: [tokens, vocab] float32 logits never exist whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.data.packing import IGNORE
from jaxtune.sharding import batch_shards, current_mesh


def chunked_cross_entropy(
    hidden: jax.Array, head: jax.Array, labels: jax.Array, *, chunk_size: int = 1024
) -> tuple[jax.Array, jax.Array]:
    """(sum of token losses, number of label tokens) for hidden [..., T, H], head [V, H], labels [..., T].

    Logits are computed about `chunk_size` tokens (per device) at a time, in float32 from operands in the
    head's dtype, and recomputed in the backward pass (jax.checkpoint), so peak memory holds one chunk of
    logits instead of [tokens, V]. Chunks run along T with every row in each, so a batch split over devices
    stays split (each device computes the loss of its own rows).
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

    @jax.checkpoint
    def chunk_loss(h_c, y_c):
        logits = jax.lax.dot_general(h_c, head, (((2,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        valid = y_c != IGNORE
        target = jnp.take_along_axis(logits, jnp.where(valid, y_c, 0)[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(valid, lse - target, 0.0))

    def body(total, xs):
        return total + chunk_loss(*xs), None

    n = (t + pad) // steps
    xs = (h.reshape(rows, n, steps, width).swapaxes(0, 1), y.reshape(rows, n, steps).swapaxes(0, 1))
    total, _ = jax.lax.scan(body, jnp.float32(0), xs)
    return total, jnp.sum(labels != IGNORE)

