"""Where each step's metrics go: RUN/metrics.jsonl always; TensorBoard event files (RUN/tb/) and a Weights &
Biases run when `report_to` asks. One process writes them (process 0 under multi-host)."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxtune.errors import JaxtuneError

# metrics.jsonl's keys -> the scalar names HF Trainer's TensorBoard and W&B callbacks use
SCALARS = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/learning_rate",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_second",
    "mfu": "train/mfu",
    "peak_memory_gib": "train/peak_memory_gib",
    "skipped": "train/skipped_steps",
    "aux_loss": "train/aux_loss",  # a mixture of experts' load-balancing loss
}
# DPO/ORPO metrics keep TRL's names: "rewards/chosen" -> train/rewards/chosen, "eval_rewards/chosen" -> eval/...
OBJECTIVE_SCALARS = ("rewards/", "logps/", "nll_loss", "log_odds_ratio", "log_odds_chosen")


def scalar_name(key: str) -> str | None:
    """The reporter's name of a metrics.jsonl key, or None for keys that are not reported (step, collapsed)."""
    if key in SCALARS:
        return SCALARS[key]
    split, name = ("eval", key[5:]) if key.startswith("eval_") else ("train", key)
    return f"{split}/{name}" if name.startswith(OBJECTIVE_SCALARS) else None


_PACKAGES = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}
WANDB_ID_FILE = "wandb-run-id"


def check_reporters(report_to: tuple[str, ...], run_dir: str | os.PathLike | None) -> None:
    """Refuses, before any work, a reporter whose package is missing or that has nowhere to write."""
    import importlib.util

    for name in report_to:
        module, extra = _PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise JaxtuneError(f"report_to {name} needs the {module} package: pip install 'jaxtune[{extra}]'")
    if "tensorboard" in report_to and run_dir is None:
        raise JaxtuneError("report_to tensorboard writes under the run directory: pass out_dir (--out)")


class MetricsLog:
    """Appends each step's record to metrics.jsonl and sends its scalars to the reporters in `report_to` (which
    `check_reporters` has passed).

    On resume the lines (and TensorBoard events) of steps after the restored checkpoint are dropped, since those
    steps run again; a W&B run continues under the id kept in the run directory.
    """

    def __init__(self, run_dir: str | None, report_to: tuple[str, ...], config: dict[str, Any], start_step: int):
        self.path = None if run_dir is None else os.path.join(run_dir, "metrics.jsonl")
        if self.path is not None:
            _truncate_metrics(self.path, start_step)
        self.tensorboard = self.wandb = None
        if "tensorboard" in report_to:
            from tensorboardX import SummaryWriter

            # an event file is named by the second it opens and the host: a resume within that second would open
            # the same file again and wipe the earlier steps, so each writer's name also carries its process and step
            self.tensorboard = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step + 1,
                                             filename_suffix=f".{os.getpid()}.{start_step}")
        if "wandb" in report_to:
            self.wandb = _wandb_run(run_dir, config)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        scalars = {scalar_name(k): float(v) for k, v in record.items() if scalar_name(k) and v is not None}
        if self.tensorboard is not None:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, record["step"])
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _wandb_run(run_dir: str | None, config: dict[str, Any]):
    """A W&B run (project from $WANDB_PROJECT, default "jaxtune"; $WANDB_MODE=offline works), resumed when the run
    directory names one."""
    import wandb

    run_id = None
    id_file = None if run_dir is None else os.path.join(run_dir, WANDB_ID_FILE)
    if id_file is not None and os.path.exists(id_file):
        with open(id_file) as f:
            run_id = f.read().strip() or None
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxtune"), dir=run_dir, config=config, id=run_id,
                     resume="allow", name=None if run_dir is None else os.path.basename(os.path.abspath(run_dir)))
    if id_file is not None and run_id is None:
        with open(id_file, "w") as f:
            f.write(run.id)
    return run


def _truncate_metrics(path: str, last_step: int) -> None:
    """On resume, drop metric lines of steps after the restored checkpoint (they will be redone)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    with open(path, "w") as f:
        f.writelines(kept)


def plot_losses(path: str, losses: list[float], eval_losses: list[tuple[int, float]]) -> None:
    """The run's loss curve (loss.png): training loss per step, held-out loss where it was evaluated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, label="train")
    if eval_losses:
        ax.plot([s for s, _ in eval_losses], [v for _, v in eval_losses], "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
