"""LoRA adapters to and from PEFT's format (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from convert.atomic import atomic_directory
from convert.safetensors_source import SafetensorsSource
from jaxtune.errors import CheckpointError
from jaxtune.jsonfile import read_json_file
from jaxtune.model import CausalLM
from jaxtune.qlora import LORA_TARGETS, PARENT_MODULE, LoRALinear, get_peft_model, projection

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight"
)


def lora_modules(model: CausalLM) -> dict[str, LoRALinear]:
    """The projections of the model that carry LoRA adapters, by name (q_proj, ...)."""
    return {name: projection(model, name) for name in LORA_TARGETS if isinstance(projection(model, name), LoRALinear)}


def save_peft(model: CausalLM, out_dir: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
    """Writes the model's LoRA adapters as a PEFT LoRA adapter directory (atomically)."""
    model.config.require_dense("exporting the adapters to PEFT")
    modules = lora_modules(model)
    if not modules:
        raise CheckpointError("the model has no LoRA adapters to save; call jaxtune.get_peft_model first")
    first = next(iter(modules.values()))
    tensors: dict[str, np.ndarray] = {}
    for name, proj in modules.items():
        a = np.asarray(proj.lora_a[...], np.float32)
        b = np.asarray(proj.lora_b[...], np.float32)
        for i in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{PARENT_MODULE[name]}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i])
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.r, "lora_alpha": first.alpha,
        "lora_dropout": first.dropout, "target_modules": sorted(modules), "bias": "none",
        "use_rslora": first.use_rslora, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path, "modules_to_save": None, "init_lora_weights": True,
    }
    with atomic_directory(out_dir) as tmp:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2)


def _read_adapter_config(adapter_dir: str) -> dict[str, Any]:
    cfg = read_json_file(os.path.join(adapter_dir, ADAPTER_CONFIG),
                         missing=f"{adapter_dir} has no {ADAPTER_CONFIG}; point to a PEFT adapter directory")
    if cfg.get("peft_type") != "LORA":
        raise CheckpointError(f"unsupported adapter type peft_type={cfg.get('peft_type')!r}; jaxtune loads LORA adapters")
    if cfg.get("use_dora"):
        raise CheckpointError("DoRA adapters (use_dora=true) are not supported; train a plain LoRA adapter")
    if cfg.get("fan_in_fan_out"):
        raise CheckpointError("fan_in_fan_out=true adapters (GPT-2 style Conv1D) are not supported for Llama-family models")
    if cfg.get("bias", "none") != "none":
        raise CheckpointError(f"adapters with bias={cfg['bias']!r} are not supported; only bias='none'")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise CheckpointError(f"target_modules={targets!r} is not a list of module names; jaxtune needs e.g. ['q_proj', 'v_proj']")
    names = sorted({t.split(".")[-1] for t in targets})
    unknown = [t for t in names if t not in LORA_TARGETS]
    if unknown:
        raise CheckpointError(f"adapter targets {', '.join(unknown)}, which jaxtune does not adapt; valid: {', '.join(LORA_TARGETS)}")
    cfg["target_modules"] = names
    return cfg


def load_peft(model: CausalLM, adapter_dir: str | os.PathLike) -> CausalLM:
    """Adds a PEFT LoRA adapter to `model` (in place; returns it): any r, alpha, rsLoRA, subset of targets."""
    adapter_dir = os.fspath(adapter_dir)
    cfg = _read_adapter_config(adapter_dir)
    if lora_modules(model):
        raise CheckpointError("the model already has LoRA adapters; load the adapter into a fresh base model")
    c = model.config
    r = int(cfg["r"])
    get_peft_model(model, r=r, lora_alpha=float(cfg.get("lora_alpha", 8)), lora_dropout=float(cfg.get("lora_dropout", 0.0)),
                   target_modules=cfg["target_modules"], use_rslora=bool(cfg.get("use_rslora", False)))
    modules = lora_modules(model)
    a = {name: np.zeros(m.lora_a[...].shape, np.float32) for name, m in modules.items()}
    b = {name: np.zeros(m.lora_b[...].shape, np.float32) for name, m in modules.items()}
    seen = set()
    with SafetensorsSource(adapter_dir) as source:
        for key in source.names():
            m = _KEY.fullmatch(key)
            if m is None:
                raise CheckpointError(f"adapter tensor {key!r} is not a LoRA A/B weight of a Llama-family layer")
            layer, _, name, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if name not in modules or layer >= c.num_layers:
                raise CheckpointError(f"adapter tensor {key} does not match this model ({c.num_layers} layers, "
                                      f"adapted: {', '.join(modules)})")
            target = a if which == "A" else b
            value = np.asarray(source.get(key), np.float32)
            if value.shape != target[name].shape[1:]:
                raise CheckpointError(f"adapter tensor {key} has shape {value.shape}, this model needs "
                                      f"{target[name].shape[1:]}: the adapter belongs to another model shape")
            target[name][layer] = value
            seen.add((layer, name, which))
    missing = [(i, n, w) for n in modules for i in range(c.num_layers) for w in "AB" if (i, n, w) not in seen]
    if missing:
        i, n, w = missing[0]
        raise CheckpointError(f"adapter lacks layers.{i}.{PARENT_MODULE[n]}.{n}.lora_{w}.weight; the adapter is incomplete")
    for name, proj in modules.items():
        proj.lora_a.set_value(jnp.asarray(a[name]))
        proj.lora_b.set_value(jnp.asarray(b[name]))
    return model
