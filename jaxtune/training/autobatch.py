"""Automatic micro-batch size from the compiled step's memory analysis (no trial runs)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from jaxtune.parallel.distributed import agree_min, memory_stats
from jaxtune.errors import JaxtuneError
from jaxtune.platform.host_info import GIB, available_ram_bytes
from jaxtune.parallel.sharding import batch_sharding, batch_shards
from jaxtune.training.config import TrainConfig

CANDIDATES = (64, 32, 16, 8, 4, 2, 1)
CPU_DEFAULT = 4
MARGIN = 0.9  # use at most this fraction of device memory
LINE_SLACK = 1.03  # how far over the budget the fitted line may put a candidate that is still compiled to check
BATCH_KEYS = ("input_ids", "labels", "segment_ids", "positions")
# Sizing compiles skip GEMM autotuning on GPU: the memory plan does not depend on the GEMM algorithms, and
# autotuning is most of a step's compile time. These options override the step's own (compilation.py: jit's
# options first, then these, in one dict)
SIZING_OPTIONS_GPU = {"xla_gpu_autotune_level": 0}


def step_bytes(step_fn, lora, opt_state, frozen, micro: int, cfg: TrainConfig) -> int:
    """Device bytes the compiled step needs at this micro-batch (arguments + outputs + temporaries)."""
    return _step_memory(step_fn, lora, opt_state, frozen, micro, cfg)[0]


def step_bytes_or_none(step_fn, lora, opt_state, frozen, micro: int, cfg: TrainConfig) -> int | None:
    """`step_bytes`, or None when compiling the step itself runs out of device memory."""
    try:
        return step_bytes(step_fn, lora, opt_state, frozen, micro, cfg)
    except Exception as e:  # noqa: BLE001 (compilation itself may run out of memory)
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return None


def _step_memory(step_fn, lora, opt_state, frozen, micro: int, cfg: TrainConfig) -> tuple[int, int]:
    """(total bytes, temporary bytes) of the step compiled for this micro-batch. On CPU the compilation is the one
    the training loop then runs (jit reuses it for the same shapes); on GPU it skips autotuning (fast), and the size
    finally chosen compiles once more, tuned, when training starts."""
    shape = (cfg.grad_accum, micro, cfg.seq_len)
    mesh = getattr(step_fn, "mesh", None)
    sharding = None if mesh is None else batch_sharding(mesh)  # then the plan is per device
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in BATCH_KEYS}
    for k, (trailing, dtype) in getattr(step_fn, "batch_extra", {}).items():
        batch[k] = jax.ShapeDtypeStruct(shape[:2] + tuple(trailing), dtype, sharding=sharding)
    batch["stop"] = jax.ShapeDtypeStruct((cfg.grad_accum, micro, 1), jnp.int32, sharding=sharding)
    options = SIZING_OPTIONS_GPU if jax.default_backend() == "gpu" else None
    # an array donated to a step that then failed is deleted, but its shape still plans the step (live arrays stay:
    # then jit reuses this compilation for the step itself)
    lora, opt_state, frozen = (jax.tree.map(_shape_if_deleted, tree) for tree in (lora, opt_state, frozen))
    compiled = step_fn.lower(lora, opt_state, frozen, batch, jnp.int32(0)).compile(compiler_options=options)
    mem = compiled.memory_analysis()
    # arrays kept in host memory (offload_optimizer, offload_embedding) are not in these totals: XLA counts them
    # apart, in its host_* fields (measured on an H100)
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return int(total), int(mem.temp_size_in_bytes)


def _shape_if_deleted(x):
    if isinstance(x, jax.Array) and x.is_deleted():
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


class StepTooLarge(JaxtuneError, MemoryError):
    """The training step cannot fit the device's memory at the smallest batch the run allows."""


def too_large(cfg: TrainConfig, micro: int, need: int | None, available: int, where: str) -> StepTooLarge:
    """The one-line refusal: what the step needs, what there is, and what to change."""
    needs = "more than" if need is None else f"{need / GIB:,.1f} GiB,"
    fixes = [f"a shorter --seq-len (now {cfg.seq_len:,})"]
    if micro > 1:
        fixes.append(f"a smaller --batch-size (now {micro})")
    if cfg.remat != "offload" and where == "the device":  # on CPU the host is the device: offloading saves nothing
        fixes.append("--remat offload (layer inputs in host memory)")
    if need is not None and need <= available:  # planned to fit, ran out of memory when it ran
        return StepTooLarge(f"the training step ran out of memory: it needs {need / GIB:,.1f} GiB by its plan and "
                            f"{where} has {available / GIB:,.1f} GiB, too little beside what the plan leaves out "
                            f"(allocator, GEMM autotuning); use {', or '.join(fixes)}")
    return StepTooLarge(f"the training step does not fit: it needs {needs} {where} has {available / GIB:,.1f} GiB; "
                        f"use {', or '.join(fixes)}")


def refuse_if_too_large_for_host(step_fn, lora, opt_state, frozen, micro: int, cfg: TrainConfig) -> None:
    """On CPU (no device memory size), compare the compiled step with the host memory available now, before the
    first step allocates it: the compilation is the one the loop then runs, so this costs no extra compile."""
    if memory_stats().get("bytes_limit") is not None:
        return  # GPU: the loop turns an out-of-memory first step into `too_large`, at no compile before it
    resident = sum(x.nbytes for x in jax.tree.leaves((lora, opt_state, frozen)))  # already in memory
    need = step_bytes_or_none(step_fn, lora, opt_state, frozen, micro, cfg)
    available = available_ram_bytes()
    fits = need is not None and need - resident <= available
    if not agree_min(int(fits)):
        raise too_large(cfg, micro, None if need is None else need - resident, available, "host memory")


def choose_micro_batch(cfg: TrainConfig, step_fn, lora, opt_state, frozen, *, bytes_limit: int | None = None,
                       rows: int | None = None) -> int:
    """The largest candidate micro-batch whose compiled step fits device memory with a margin, and that the
    dataset's `rows` (packed rows) can fill; the same on every process (the smallest any process chose).

    Memory is linear in the micro-batch; see `_largest_fitting` for how few compilations find the size.
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
    """One compilation beyond the one training runs, as a rule: micro 1 bounds the per-row memory from above (all
    its temporaries counted as per-row), the largest candidate under that bound is compiled and measured, and
    only when the measured line shows a larger candidate fits is that one compiled too."""

    def measure(count: int) -> int | None:
        return step_bytes_or_none(step_fn, lora, opt_state, frozen, count * unit, cfg)

    one, temp_one = _step_memory(step_fn, lora, opt_state, frozen, unit, cfg)
    allowed = [c for c in CANDIDATES if c <= most]  # largest first
    if one > budget or allowed[0] == 1:
        return unit
    guess = next((c for c in allowed if one + (c - 1) * max(temp_one, 1) <= budget), 1)
    guess = max(guess, min(c for c in allowed if c > 1))  # the bound is loose: always try a second point
    while guess > 1:
        need = measure(guess)
        if need is not None and need <= budget:
            break
        guess = next((c for c in allowed if c < guess), 1)  # step down, compiling each
    if guess == 1:
        return unit
    per_row = max((need - one) / (guess - 1), 1.0)
    # memory is close to, not exactly, linear: a candidate the line puts just over the budget is measured too
    larger = next((c for c in allowed if c > guess and one + (c - 1) * per_row <= budget * LINE_SLACK), None)
    if larger is not None:
        bigger = measure(larger)
        if bigger is not None and bigger <= budget:
            return larger * unit
    return guess * unit
