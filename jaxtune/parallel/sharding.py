"""Device mesh and sharding rules: data parallel over `data`, FSDP over `fsdp`, on JAX's SPMD partitioner.

The batch is split over both axes; frozen 4-bit weights, LoRA params and optimizer state are split over
`fsdp` (each array along its largest dimension that divides evenly; the stacked-layer axis never, so the
layer scan slices locally). Each layer's LoRA matrices and NF4 arrays are gathered whole where they are used
(`whole_on_every_device`), so every device computes its own rows and only weights move; XLA inserts those
all-gathers and the gradients' reduce-scatters. The Pallas kernels, which it cannot partition, run per shard
under `shard_map` (see `jaxtune.ops`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtune.errors import JaxtuneError

AXES = ("data", "fsdp")
BATCH_AXES = AXES  # the micro-batch dimension is split over every device
MIN_SHARDED_ELEMENTS = 2**14  # smaller arrays (norm scales, absmax-of-absmax) stay replicated


class MeshError(JaxtuneError, ValueError):
    """A mesh spec that does not describe the devices at hand."""


def mesh_axis_sizes(spec: str | Mapping[str, int]) -> dict[str, int]:
    """The sizes a spec names ("data=2,fsdp=4" or a mapping; -1 = the remaining devices), its form checked."""
    if isinstance(spec, str):
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            m = re.fullmatch(r"(\w+)\s*=\s*(-?\d+)", part)
            if not m:
                raise MeshError(f"mesh {spec!r}: {part!r} is not axis=size; write e.g. data=2,fsdp=4")
            sizes[m.group(1)] = int(m.group(2))
    else:
        sizes = {str(k): int(v) for k, v in spec.items()}
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise MeshError(f"mesh {spec!r}: unknown axis {sorted(unknown)[0]!r}; the axes are data and fsdp")
    if any(v < 1 and v != -1 for v in sizes.values()):
        raise MeshError(f"mesh {spec!r}: axis sizes must be positive (or -1 for the remaining devices)")
    return {a: sizes.get(a, -1) for a in AXES}


def parse_mesh(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """{"data": d, "fsdp": f} with d * f == num_devices; None puts every device on `data`.

    One axis may be left out (or -1) and takes the remaining devices.
    """
    sizes = mesh_axis_sizes(spec or {})
    free = [a for a in AXES if sizes[a] == -1]
    if len(free) == len(AXES):
        return {"data": num_devices, "fsdp": 1}
    fixed = math.prod(sizes[a] for a in AXES if a not in free)
    if free:
        if num_devices % fixed:
            raise MeshError(f"mesh {spec!r} does not divide the {num_devices} devices; pick sizes whose product "
                            f"is {num_devices}")
        sizes[free[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(f"mesh {spec!r} needs {fixed} devices but there are {num_devices}; pick sizes whose "
                        f"product is {num_devices}")
    return sizes


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: list | None = None) -> Mesh:
    """The training mesh over all devices of all processes (or `devices`), axes ("data", "fsdp")."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec, len(devices))
    return Mesh(np.asarray(devices).reshape(sizes["data"], sizes["fsdp"]), AXES)


def array_spec(shape: tuple[int, ...], fsdp: int, *, stacked: bool) -> P:
    """FSDP rule for one array: its largest dimension divisible by `fsdp` goes on the `fsdp` axis."""
    if fsdp == 1 or math.prod(shape) < MIN_SHARDED_ELEMENTS:
        return P()
    first = 1 if stacked and len(shape) > 1 else 0
    dims = sorted(range(first, len(shape)), key=lambda d: -shape[d])
    for d in dims:
        if shape[d] % fsdp == 0:
            return P(*([None] * d), "fsdp")
    return P()


def state_shardings(mesh: Mesh, tree: Any) -> Any:
    """NamedShardings for a pytree of model/optimizer arrays (paths under `layers` are layer-stacked)."""
    fsdp = mesh.shape["fsdp"]

    def rule(path, leaf):
        stacked = "layers" in jax.tree_util.keystr(path)
        shape = getattr(leaf, "shape", ())
        return NamedSharding(mesh, array_spec(tuple(shape), fsdp, stacked=stacked))

    return jax.tree_util.tree_map_with_path(rule, tree)


def shard_state(mesh: Mesh, tree: Any) -> Any:
    """`tree` placed on the mesh by the FSDP rule."""
    return jax.device_put(tree, state_shardings(mesh, tree))


def current_mesh():
    """The mesh in context (`jax.set_mesh`, as the training step is traced), or None when there is none, it has
    one device, or the code runs per device inside a `shard_map` over all its axes (as on one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 or mesh.are_all_axes_manual else mesh


def whole_on_every_device(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """`arrays` gathered whole on every device of the mesh in context (as they are without one): FSDP's
    all-gather at use. LoRA's matrices left split along their long dimension make XLA split the LoRA matmuls'
    outputs along the hidden dimension instead, and then move [tokens, hidden] activations between devices to
    add them to the batch-split base output; gathered, they cost a few MB per layer."""
    if current_mesh() is None:
        return arrays
    return tuple(jax.lax.with_sharding_constraint(x, P()) for x in arrays)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[accum, micro_batch, T] batches: the micro-batch split over every device."""
    return NamedSharding(mesh, P(None, BATCH_AXES, None))


def batch_shards(mesh) -> int:
    """Devices the micro-batch is split over (a Mesh or the abstract mesh in context)."""
    return math.prod(mesh.shape.get(a, 1) for a in BATCH_AXES)


def global_rows(mesh: Mesh, rows: np.ndarray) -> jax.Array:
    """The global [N, ...] array, its rows split over every device, from the (identical on every host) host array;
    each process transfers only its own rows."""
    n, p = jax.process_count(), jax.process_index()
    if len(rows) % n:
        raise MeshError(f"{len(rows)} rows do not split over {n} processes; use a multiple of {n}")
    local = rows[p * len(rows) // n:(p + 1) * len(rows) // n]
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P(BATCH_AXES)), local, rows.shape)


def global_batch(mesh: Mesh, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """The global [accum, B, T] arrays from this process's rows of the (identical on every host) host batch.

    Each process transfers only its own slice of the micro-batch dimension; single-process runs transfer all.
    """
    sharding = batch_sharding(mesh)
    n, p = jax.process_count(), jax.process_index()
    out = {}
    for k, v in batch.items():
        rows = v.shape[1]
        if rows % n:
            raise MeshError(f"micro-batch {rows} does not split over {n} processes; use a multiple of {n}")
        local = v[:, p * rows // n:(p + 1) * rows // n]
        out[k] = jax.make_array_from_process_local_data(sharding, local, v.shape)
    return out
