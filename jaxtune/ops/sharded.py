"""Pallas kernels (and the blocks around them) on a device mesh: XLA cannot partition a custom call, so each runs
per shard in `shard_map`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxtune.parallel.sharding import BATCH_AXES, batch_shards, current_mesh


def per_batch_shard(fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """fn on each device's slice of the batch (dim 0) on a mesh."""
    return per_batch_shard_with(fn, args, ())


def per_batch_shard_with(fn: Callable[..., Any], sharded: tuple[jax.Array, ...], replicated: tuple[Any, ...]) -> Any:
    """fn(*sharded, *replicated) per device on a mesh: `sharded` split on dim 0 over the batch axes (when it
    divides), `replicated` (arrays or pytrees of them) whole on every device (FSDP-sharded weights are
    all-gathered going in; a trainable one's gradient is summed over the devices). Every output of fn (an array
    or a pytree of them) is its device's rows on dim 0."""
    mesh = current_mesh()
    if mesh is None:
        return fn(*sharded, *replicated)
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    lead = axes if sharded[0].shape[0] % batch_shards(mesh) == 0 else None
    specs = tuple(P(lead) for _ in sharded) + tuple(P() for _ in replicated)
    return jax.shard_map(fn, in_specs=specs, out_specs=P(lead), check_vma=False)(*sharded, *replicated)


def replicated(fn: Callable[..., jax.Array], *args: jax.Array) -> jax.Array:
    """fn on whole operands on every device of a mesh: FSDP-sharded weights are all-gathered going in."""
    if current_mesh() is None:
        return fn(*args)
    return jax.shard_map(fn, in_specs=tuple(P() for _ in args), out_specs=P(), check_vma=False)(*args)
