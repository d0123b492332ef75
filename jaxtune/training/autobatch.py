"""Automatic micro-batch size from the compiled step's memory analysis (no trial runs)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxtune.distributed import agree_min, memory_stats
from jaxtune.sharding import batch_sharding, batch_shards
from jaxtune.training.config import TrainConfig

CANDIDATES = (64, 32, 16, 8, 4, 2, 1)
CPU_DEFAULT = 4
MARGIN = 0.9  # use at most this fraction of device memory
BATCH_KEYS = ("input_ids", "labels", "segment_ids", "positions")


def step_bytes(step_fn, lora, opt_state, frozen, micro: int, cfg: TrainConfig) -> int:
    """Device bytes the compiled step needs at this micro-batch (arguments + outputs + temporaries)."""
    shape = (cfg.grad_accum, micro, cfg.seq_len)
    mesh = getattr(step_fn, "mesh", None)
    sharding = None if mesh is None else batch_sharding(mesh)  # then the plan is per device
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in BATCH_KEYS}
    batch["stop"] = jax.ShapeDtypeStruct((cfg.grad_accum, micro, 1), jnp.int32, sharding=sharding)
    compiled = step_fn.lower(lora, opt_state, frozen, batch, jnp.int32(0)).compile()
    mem = compiled.memory_analysis()
    return int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)


def choose_micro_batch(cfg: TrainConfig, step_fn, lora, opt_state, frozen, *, bytes_limit: int | None = None,
                       rows: int | None = None) -> int:
    """The largest candidate micro-batch whose compiled step fits device memory with a margin, and that the
    dataset's `rows` (packed rows) can fill; the same on every process (the smallest any process chose).

    Memory is linear in the micro-batch: two compilations (micro 1 and 2) give the line, the largest
    candidate under the budget is then compiled once to confirm (stepping down while it does not fit).
    """
    mesh = getattr(step_fn, "mesh", None)
    unit = 1 if mesh is None else batch_shards(mesh)  # micro-batches split evenly over the mesh's devices
    most = CANDIDATES[0] if rows is None else max(rows // (cfg.grad_accum * unit), 1)
    if bytes_limit is None:
        bytes_limit = memory_stats().get("bytes_limit")
    if bytes_limit is None:
        warnings.warn(f"device memory size unknown (CPU); micro_batch_size='auto' uses {min(CPU_DEFAULT, most) * unit}",
                      stacklevel=3)
        return agree_min(min(CPU_DEFAULT, most) * unit)
    return agree_min(_largest_fitting(cfg, step_fn, lora, opt_state, frozen, bytes_limit * MARGIN, unit, most))


def _largest_fitting(cfg, step_fn, lora, opt_state, frozen, budget: float, unit: int, most: int) -> int:
    one = step_bytes(step_fn, lora, opt_state, frozen, unit, cfg)
    if one > budget or most == 1:
        return unit
    per_unit = max(step_bytes(step_fn, lora, opt_state, frozen, 2 * unit, cfg) - one, 1)
    for count in CANDIDATES:
        if count > most or one + (count - 1) * per_unit > budget:
            continue
        if count <= 2:  # measured exactly above
            return count * unit
        try:
            if step_bytes(step_fn, lora, opt_state, frozen, count * unit, cfg) <= budget:
                return count * unit
        except Exception as e:  # noqa: BLE001 (compilation itself may run out of memory)
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
    return unit
