"""jaxtune: QLoRA fine-tuning of Llama-family models in JAX."""

from __future__ import annotations

import os
from typing import Any

# jaxtune needs no PyTorch: transformers' import-time note that it is missing is noise on every command
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxtune.platform.device_memory_env import set_device_memory_fraction
from jaxtune.platform.host_info import set_pinned_host_cap

set_pinned_host_cap()  # before any JAX backend starts
set_device_memory_fraction()

from jaxtune.models.config import ModelConfig
from jaxtune.ops.dispatch import kernel_mode, set_kernels
from jaxtune.errors import CheckpointError, ConfigError, JaxtuneError, UnsupportedModelError
from jaxtune.generate import generate
from jaxtune.quant import nf4
from jaxtune.models.causal_lm import CausalLM, init_model
from jaxtune.qlora import get_peft_model, quantize_layers
from jaxtune.training import TrainConfig, TrainingDiverged, TrainResult, train

__version__ = "0.1.0"

# Checkpoint I/O lives in the `convert` package (which imports jaxtune); re-exported lazily to avoid a cycle.
_FROM_CONVERT = {
    "from_pretrained": "convert.load",
    "convert": "convert.convert",
    "save_peft": "convert.peft_io",
    "load_peft": "convert.peft_io",
    "save_merged": "convert.merged",
    "save_gguf": "convert.gguf_export",
}


def __getattr__(name: str) -> Any:
    if name in _FROM_CONVERT:
        import importlib

        return getattr(importlib.import_module(_FROM_CONVERT[name]), name)
    raise AttributeError(f"module 'jaxtune' has no attribute {name!r}")


# modules that moved into packages by concern, still importable by their first names (`import jaxtune.model`): the
# same module objects, so what is patched or read through either name is one thing
MOVED_MODULES = {"model": "models.causal_lm", "config": "models.config", "layer_loop": "models.layer_loop", "nf4": "quant.nf4",
                 "remat": "models.remat", "rope": "models.rope", "sharding": "parallel.sharding",
                 "distributed": "parallel.distributed", "bundled": "io.bundled", "hub": "io.hub",
                 "jsonfile": "io.jsonfile", "host_info": "platform.host_info",
                 "device_memory_env": "platform.device_memory_env"}


def _alias_moved_modules() -> None:
    import importlib
    import sys

    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(f"jaxtune.{new}")  # each already imported by the package's own imports
        sys.modules.setdefault(f"jaxtune.{old}", module)
        globals().setdefault(old, module)


_alias_moved_modules()


__all__ = [
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "JaxtuneError",
    "ModelConfig",
    "TrainConfig",
    "TrainResult",
    "TrainingDiverged",
    "UnsupportedModelError",
    "convert",
    "from_pretrained",
    "generate",
    "get_peft_model",
    "init_model",
    "kernel_mode",
    "load_peft",
    "nf4",
    "quantize_layers",
    "save_gguf",
    "save_merged",
    "save_peft",
    "set_kernels",
    "train",
]
