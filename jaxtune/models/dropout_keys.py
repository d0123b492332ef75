"""LoRA dropout's keys: one per projection, folded from the layer's key."""

from __future__ import annotations

import jax


def fold_rng(rng: jax.Array | None, index: int) -> jax.Array | None:
    """A distinct key per projection (None stays None: dropout off)."""
    return None if rng is None else jax.random.fold_in(rng, index)
