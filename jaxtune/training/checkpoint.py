"""Run checkpoints with orbax: LoRA params, optimizer state, step and data position; resumable exactly.

orbax writes each checkpoint to a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtune.errors import JaxtuneError


def saved_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps checkpointed under run_dir (finished saves only: orbax renames a step's directory to its number
    when the save completes)."""
    directory = os.path.join(os.fspath(run_dir), "checkpoints")
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


# what a checkpoint depends on: the adapters' shapes and scale, the objective, the optimizer, the data order. A resumed
# run keeps them (max_steps, logging, saving, eval cadence and memory settings may change)
RUN_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "objective", "format",
                "seq_len", "packing", "train_on_all", "eval_fraction", "seed", "grad_accum", "learning_rate",
                "schedule", "warmup_steps", "weight_decay", "adam_b1", "adam_b2", "max_grad_norm", "beta", "dpo_loss",
                "label_smoothing", "orpo_lambda", "share_prompt", "drop_long_prompts", "precompute_reference")


def check_run_dir(run_dir: str | os.PathLike | None, resume: bool, config: Any = None) -> None:
    """Refuses, before any work, a run directory the run could not use: a file, an unwritable place, one that
    already holds checkpoints while resume is off, or (with `config`) a resume that changes a setting the
    checkpoints depend on. Creates nothing."""
    if run_dir is None:
        return
    path = os.path.abspath(os.fspath(run_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise JaxtuneError(f"output {run_dir} is a file; choose a directory path for the run")
    steps = saved_steps(path)
    if steps and not resume:
        raise JaxtuneError(f"{run_dir} already holds checkpoints (step {steps[-1]}); pass resume=True (--resume) "
                           "to continue, or choose a new output directory")
    if steps and config is not None:
        check_resume_settings(path, config)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise JaxtuneError(f"cannot write the run directory {run_dir}: {existing} is not writable; choose another "
                           "output directory")


def check_resume_settings(run_dir: str, config: Any) -> None:
    """The run's recorded settings (RUN/config.json) against the resumed run's: a change is refused in one line
    naming the setting, the run's value and the fix."""
    import json

    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            recorded = json.load(f)["train"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # nothing recorded to compare with (a run from before config.json held it)
    requested = config.to_dict()
    for name in RUN_SETTINGS:
        if name not in recorded:
            continue
        was, now = recorded[name], requested[name]
        if isinstance(was, list):
            was, now = sorted(was), sorted(now)
        if was != now:
            raise JaxtuneError(f"{run_dir} was trained with {name}={_show(recorded[name])}, not {_show(requested[name])}: "
                               f"its checkpoints depend on it; resume with {name}={_show(recorded[name])} (as the run "
                               "was started), or train into a new output directory")


def _show(value: Any) -> str:
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


class RunCheckpoints:
    def __init__(self, run_dir: str, *, max_to_keep: int = 2):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, lora: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        """Saves (overwriting nothing: a step already saved is skipped)."""
        if step in self.manager.all_steps():
            return
        tree = {"lora": jax.tree.leaves(lora), "opt": jax.tree.leaves(opt_state)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, lora: Any, opt_state: Any, step: int | None = None) -> tuple[Any, Any, dict[str, Any]]:
        """(lora, opt_state, meta) of a saved step, shaped like the given (abstract or concrete) trees."""
        step = self.latest_step() if step is None else step
        def spec(x):  # restored with the layout of the live arrays (sharded over a mesh, or one device)
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))

        abstract = {"lora": [spec(x) for x in jax.tree.leaves(lora)], "opt": [spec(x) for x in jax.tree.leaves(opt_state)]}
        out = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        state = out["state"]
        lora = jax.tree.unflatten(jax.tree.structure(lora), state["lora"])
        opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), state["opt"])
        return lora, opt_state, dict(out["meta"])

    def close(self) -> None:
        self.manager.close()
