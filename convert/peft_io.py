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
from jaxtune.moe.experts import LoRAExperts
from jaxtune.qlora import LORA_TARGETS, PARENT_MODULE, LoRALinear, get_peft_model, projection

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.default)?\.weight"
)


def lora_modules(model: CausalLM) -> dict[str, LoRALinear]:
    """The projections of the model that carry LoRA adapters, by name (q_proj, ...)."""
    return {name: projection(model, name) for name in LORA_TARGETS if isinstance(projection(model, name), LoRALinear)}


def expert_lora_modules(model: CausalLM) -> dict[str, LoRAExperts]:
    """The expert projections (gate_proj, up_proj, down_proj) of a mixture-of-experts model that carry LoRA."""
    if not model.config.num_experts:
        return {}
    return {name: projection(model, name) for name in ("gate_proj", "up_proj", "down_proj")
            if isinstance(projection(model, name), LoRAExperts)}


def _expert_tensors(experts: dict[str, LoRAExperts], layers: int) -> dict[str, np.ndarray]:
    """PEFT's LoRA on transformers' fused expert parameters (`target_parameters`): gate_up_proj [E, 2I, H] takes
    the gate and up adapters as one of rank 2r (A stacked, B block-diagonal; a projection without LoRA adds zeros),
    down_proj [E, H, I] its own. PEFT stores A as [E * r, in] (expert-major) and B as [out, r * E] (rank-major),
    and nests the wrappers in parameter order: gate_up_proj's under `experts.base_layer`, down_proj's at
    `experts`."""
    def factors(name, like):
        if name in experts:
            return np.asarray(experts[name].lora_a[...], np.float32), np.asarray(experts[name].lora_b[...], np.float32)
        a, b = like
        return np.zeros_like(a), np.zeros_like(b)

    some = next(iter(experts.values()))
    like = (np.asarray(some.lora_a[...], np.float32), np.asarray(some.lora_b[...], np.float32))
    (ga, gb), (ua, ub), (da, db) = (factors(name, like) for name in ("gate_proj", "up_proj", "down_proj"))
    tensors = {}
    for i in range(layers):
        e, inter, r = gb.shape[1], gb.shape[2], gb.shape[3]
        a = np.concatenate([ga[i], ua[i]], axis=1)  # [E, 2r, H]
        b = np.zeros((e, 2 * inter, 2 * r), np.float32)
        b[:, :inter, :r], b[:, inter:, r:] = gb[i], ub[i]
        for module, (a_i, b_i) in {"experts.base_layer": (a, b), "experts": (da[i], db[i])}.items():
            prefix = f"base_model.model.model.layers.{i}.mlp.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a_i.reshape(-1, a_i.shape[-1]))
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_i.transpose(1, 2, 0).reshape(b_i.shape[1], -1))
    return tensors


def save_peft(model: CausalLM, out_dir: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
    """Writes the model's LoRA adapters as a PEFT LoRA adapter directory (atomically). A mixture-of-experts model's
    expert adapters go on transformers' fused expert parameters (`target_parameters`, see `_expert_tensors`)."""
    modules, experts = lora_modules(model), expert_lora_modules(model)
    if not modules and not experts:
        raise CheckpointError("the model has no LoRA adapters to save; call jaxtune.get_peft_model first")
    if experts and "down_proj" not in experts:  # PEFT would nest gate_up_proj's wrapper one level up
        raise CheckpointError("PEFT export of expert adapters needs LoRA on down_proj too; add it to target_modules")
    first = next(iter({**modules, **experts}.values()))
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
    if experts:
        tensors.update(_expert_tensors(experts, model.config.num_layers))
        # gate_up_proj's adapter has rank 2r; PEFT forbids rank patterns with rsLoRA, so the scale s = alpha / r
        # (or alpha / sqrt(r)) is written as a plain alpha for each rank
        config.update(r=first.r, lora_alpha=first.scale * first.r, use_rslora=False,
                      rank_pattern={"gate_up_proj": 2 * first.r}, alpha_pattern={"gate_up_proj": first.scale * 2 * first.r},
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
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
    if cfg.get("target_parameters"):
        raise CheckpointError(f"the adapter targets parameters {cfg['target_parameters']} (mixture-of-experts expert "
                              "adapters), which jaxtune exports but does not read back yet; load it with peft")
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
