"""What each projection's input columns carry over a text: the sum over its tokens of every column's square.

llama.cpp's importance matrix is these sums (over the tokens of a calibration text, divided by their count): a 4-bit
quantizer then spends its precision on the columns whose inputs are large. A layer traced inside `collecting` adds
its projections' sums to the collector; outside it, `observe` does nothing and costs nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

_collector: contextvars.ContextVar[tuple[jax.Array, dict[str, jax.Array]] | None] = contextvars.ContextVar(
    "input_stats", default=None)


@contextlib.contextmanager
def collecting(token_mask: jax.Array) -> Iterator[dict[str, jax.Array]]:
    """{projection name: [in] float32 sum of squares over the tokens `token_mask` [B, T] marks} of the layer traced
    inside."""
    got: dict[str, jax.Array] = {}
    reset = _collector.set((token_mask.astype(jnp.float32), got))
    try:
        yield got
    finally:
        _collector.reset(reset)


def observe(names: tuple[str, ...], x: jax.Array) -> None:
    """Records x [B, T, in], the input of the projections `names`, while collecting."""
    got = _collector.get()
    if got is None:
        return
    mask, stats = got
    squares = jnp.einsum("bt,bti->i", mask, jnp.square(x.astype(jnp.float32)))
    for name in names:
        stats[name] = stats[name] + squares if name in stats else squares
