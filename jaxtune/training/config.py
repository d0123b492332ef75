"""TrainConfig: every knob of a run, loadable from YAML and saved beside the run."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxtune.errors import JaxtuneError

SCHEDULES = ("constant", "linear", "cosine")
REMAT = ("none", "selective", "per-layer", "offload")


class ConfigError(JaxtuneError, ValueError):
    """A training option is out of range or unknown."""


@dataclasses.dataclass
class TrainConfig:
    # data
    format: str = "chat"
    seq_len: int = 1024
    packing: bool = True
    train_on_all: bool = False
    eval_fraction: float = 0.0
    seed: int = 0
    # batch
    micro_batch_size: int | str = 4  # or "auto": the largest that fits device memory
    grad_accum: int = 1
    # optimizer
    learning_rate: float = 2e-4
    schedule: str = "cosine"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    max_grad_norm: float = 1.0
    max_steps: int = 100
    # model
    lora_r: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    use_rslora: bool = False
    remat: str = "selective"  # measured faster and leaner than "none" at every batch (benchmarks/results)
    ce_chunk_size: int = 1024
    # "fp8": the frozen projections (forward and input gradient, but q/k's forward) as FP8 GEMMs; LoRA, norms,
    # attention and the loss keep the model's dtype. Opt-in: see benchmarks/results for speed and accuracy
    compute: str = "bf16"
    # GPU: keep compiled steps in JAX's persistent compilation cache (jaxtune.training.compilation), so a rerun
    # or a resumed run loads its step in seconds instead of compiling it again
    compile_cache: bool = True
    # devices: "data=2,fsdp=4" (see jaxtune.sharding); None = every device on the data axis
    mesh: str | None = None
    # loop
    logging_steps: int = 1
    eval_steps: int = 0
    save_steps: int = 0
    max_bad_steps: int = 5

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if self.remat not in REMAT:
            raise ConfigError(f"unknown remat {self.remat!r}; choose one of: {', '.join(REMAT)}")
        from jaxtune.ops import COMPUTE_MODES

        if self.compute not in COMPUTE_MODES:
            raise ConfigError(f"unknown compute {self.compute!r}; choose one of: {', '.join(COMPUTE_MODES)}")
        if self.micro_batch_size != "auto" and (not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1):
            raise ConfigError(f"micro_batch_size must be a positive integer or 'auto', got {self.micro_batch_size!r}")
        for name in ("seq_len", "grad_accum", "max_steps", "lora_r", "ce_chunk_size", "max_bad_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.mesh is not None:
            from jaxtune.sharding import mesh_axis_sizes

            try:  # the form only here; whether it fits the devices is checked when the run starts
                mesh_axis_sizes(self.mesh)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> "TrainConfig":
        import yaml

        try:
            with open(path) as f:
                values = yaml.safe_load(f) or {}
        except OSError:
            raise ConfigError(f"config file {path} cannot be read; check the path") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path} must hold a mapping of option: value")
        return cls.from_dict({**values, **overrides}, where=str(path))

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "config") -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_modules"] = list(self.target_modules)
        return d
