"""jaxtune: QLoRA fine-tuning of Llama-family models in JAX."""

from __future__ import annotations

import os
from typing import Any


def _raise_pinned_host_cap() -> None:
    """Long-context training offloads layer inputs to pinned host memory, which XLA caps at 64 GB by default
    (409,600 tokens of Llama-3-8B need 100 GiB): unless the user set it, allow 90% of physical RAM."""
    if "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in os.environ:
        return
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(max(64, int(0.9 * ram / 1e9)))


_raise_pinned_host_cap()

from jaxtune.config import ModelConfig
from jaxtune.dispatch import kernel_mode, set_kernels
from jaxtune.errors import CheckpointError, JaxtuneError, UnsupportedModelError
from jaxtune.generate import generate
from jaxtune import nf4
from jaxtune.model import CausalLM, init_model
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


__all__ = [
    "CausalLM",
    "CheckpointError",
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
