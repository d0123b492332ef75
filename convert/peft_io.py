"""LoRA adapters to and from PEFT's format (adapter_config.json + adapter_model.safetensors)."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from convert.atomic import atomic_directory
from convert.moe_names import GEMMA4, fused_layout
from convert.safetensors_source import SafetensorsSource
from jaxtune.errors import CheckpointError
from jaxtune.io.jsonfile import read_json_file
from jaxtune.models.causal_lm import CausalLM
from jaxtune.models.layer_kinds import has_experts, sparse_layers
from jaxtune.moe.experts import LoRAExperts
from jaxtune.qlora import ALL_TARGETS, PARENT_MODULE, LoRALinear, get_peft_model, projection, projection_names

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# a projection that is a module of its own: attention's, a Gated DeltaNet layer's, an MLP's or a shared expert's
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|linear_attn|mlp(?:\.shared_expert)?)\.\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight")
# PEFT's LoRA on transformers' fused expert parameters, wrapped in parameter order (the first innermost): under the
# MLP (`mlp.experts`), or beside it (Gemma 4's `experts`)
_EXPERT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.((?:mlp\.)?experts)((?:\.base_layer)*)"
                         r"\.lora_([AB])(?:\.default)?\.weight")
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
# a 2-D projection weight targeted as a parameter (a mixture of experts' dense or shared MLP)
_DENSE_PARAM = re.compile(r"(?:.*\.)?(mlp(?:\.shared_expert)?\.(?:gate_proj|up_proj|down_proj))\.weight")
_MLP = ("gate_proj", "up_proj", "down_proj")


def expert_site(cfg) -> tuple[str, str, bool]:
    """(the jaxtune module holding a layer's routed experts, transformers' module of their fused parameters, whether
    gate and up alternate in gate_up_proj's columns)."""
    layout = fused_layout(cfg.model_type)
    if layout == GEMMA4:
        return layout.module, "experts", False
    return "mlp", "mlp.experts", bool(layout and layout.interleaved)


def module_projections(model: CausalLM, stack, layers) -> dict[str, Any]:
    """{transformers' module path in the layer (`self_attn.q_proj`, `mlp.shared_expert.up_proj`): projection} of a
    stack's projections that are modules of their own; routed experts are fused parameters, not modules."""
    routed = has_experts(model.config, stack) and expert_site(model.config)[0] == "mlp"
    out = {f"{PARENT_MODULE[n]}.{n}": projection(model, n, stack.attr) for n in projection_names(layers)
           if not (routed and PARENT_MODULE[n] == "mlp")}
    shared = getattr(getattr(layers, "mlp", None), "shared_expert", None)
    if shared is not None:
        out.update({f"mlp.shared_expert.{n}": getattr(shared, n) for n in _MLP})
    return out


def lora_modules(model: CausalLM) -> dict[tuple[str, int], tuple[LoRALinear, int]]:
    """(module path in the layer, decoder layer) -> (the stacked projection carrying its LoRA adapter, the layer's
    position in that stack), for every layer of every stack (layer kinds)."""
    out = {}
    for stack, layers in model.layer_stacks():
        for path, proj in module_projections(model, stack, layers).items():
            if isinstance(proj, LoRALinear):
                out.update({(path, layer): (proj, j) for j, layer in enumerate(stack.layers)})
    return out


def expert_lora_modules(model: CausalLM, stack: str = "layers") -> dict[str, LoRAExperts]:
    """The routed expert projections (gate_proj, up_proj, down_proj) of a mixture-of-experts model that carry
    LoRA, in one stack of sparse layers (`layers`, or gpt-oss's `sliding_attention_layers`)."""
    if not model.config.num_experts:
        return {}
    experts = getattr(getattr(model, stack), expert_site(model.config)[0], None)
    return {name: getattr(experts, name) for name in _MLP
            if isinstance(getattr(experts, name, None), LoRAExperts)}


def _sparse_stacks(model: CausalLM) -> list:
    """The stacks of layers whose MLP routes to experts."""
    return [stack for stack, _ in model.layer_stacks() if has_experts(model.config, stack)]


def _expert_param_modules(params: list[str]) -> dict[str, str]:
    """Where PEFT keeps the LoRA of each targeted fused expert parameter (given in parameter order): it wraps them
    one inside the next, so the first is under `experts.base_layer` when a second follows, the last at `experts`."""
    return {p: "experts" + ".base_layer" * (len(params) - 1 - k) for k, p in enumerate(params)}


def _expert_tensors(experts: dict[str, LoRAExperts], layers: tuple[int, ...], interleaved: bool = False,
                    hub_module: str = "mlp.experts") -> tuple[list[str], dict[str, np.ndarray]]:
    """(targeted parameters, tensors) of PEFT's LoRA on transformers' fused expert parameters
    (`target_parameters`): gate_up_proj [E, 2I, H] takes the gate and up adapters as one of rank 2r (A stacked,
    B block-diagonal; zeros for the one without LoRA), down_proj [E, H, I] its own. PEFT stores A as [E * r, in]
    (expert-major) and B as [out, r * E] (rank-major). `interleaved` (gpt-oss, whose gate_up_proj holds gate and
    up in alternate output columns): B's gate rows are the even ones, up's the odd."""
    def factors(name: str, like: LoRAExperts) -> tuple[np.ndarray, np.ndarray]:
        """name's (A, B), or zeros of the shapes of `like`'s when name has no LoRA."""
        proj = experts.get(name, like)
        a, b = (np.asarray(f[...], np.float32) for f in (proj.lora_a, proj.lora_b))
        return (a, b) if name in experts else (np.zeros_like(a), np.zeros_like(b))

    stacks: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # parameter -> (A [L, E, r, in], B [L, E, out, r])
    if "gate_proj" in experts or "up_proj" in experts:
        like = experts["gate_proj"] if "gate_proj" in experts else experts["up_proj"]
        (ga, gb), (ua, ub) = factors("gate_proj", like), factors("up_proj", like)
        inter, r = gb.shape[-2], gb.shape[-1]
        b = np.zeros((*gb.shape[:2], 2 * inter, 2 * r), np.float32)
        if interleaved:
            b[..., 0::2, :r], b[..., 1::2, r:] = gb, ub
        else:
            b[..., :inter, :r], b[..., inter:, r:] = gb, ub
        stacks["gate_up_proj"] = (np.concatenate([ga, ua], axis=-2), b)
    if "down_proj" in experts:
        stacks["down_proj"] = factors("down_proj", experts["down_proj"])
    tensors = {}
    for param, module in _expert_param_modules(list(stacks)).items():
        a, b = stacks[param]
        for j, i in enumerate(layers):  # the stack's positions and the decoder layers they are
            prefix = f"base_model.model.model.layers.{i}.{hub_module.removesuffix('experts')}{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[j].reshape(-1, a.shape[-1]))
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[j].transpose(1, 2, 0).reshape(b.shape[-2], -1))
    return list(stacks), tensors


def save_peft(model: CausalLM, out_dir: str | os.PathLike, *, base_model_name_or_path: str | None = None) -> None:
    """Writes the model's LoRA adapters as a PEFT LoRA adapter directory (atomically). A mixture-of-experts model's
    expert adapters go on transformers' fused expert parameters (`target_parameters`, see `_expert_tensors`)."""
    modules, experts = lora_modules(model), expert_lora_modules(model)
    if not modules and not experts:
        raise CheckpointError("the model has no LoRA adapters to save; call jaxtune.get_peft_model first")
    first = next(iter([*(m for m, _ in modules.values()), *experts.values()]))
    tensors: dict[str, np.ndarray] = {}
    host: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # each stacked projection's factors, read once
    for (path, i), (proj, j) in sorted(modules.items(), key=lambda item: item[0][1]):
        if id(proj) not in host:
            host[id(proj)] = tuple(np.asarray(f[...], np.float32) for f in (proj.lora_a, proj.lora_b))
        a, b = host[id(proj)]
        prefix = f"base_model.model.model.layers.{i}.{path}"
        tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[j])
        tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[j])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.r, "lora_alpha": first.alpha,
        "lora_dropout": first.dropout, "target_modules": sorted({path.rpartition(".")[2] for path, _ in modules}),
        "bias": "none",
        "use_rslora": first.use_rslora, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path, "modules_to_save": None, "init_lora_weights": True,
    }
    if model.config.num_experts:
        # peft reads target_modules gate/up/down_proj of a mixture of experts as its fused expert parameters, so a
        # dense layer's MLP adapters are named as the parameters they adapt (peft's keys are those of its modules)
        dense_mlp = sorted({path for path, _ in modules if path.startswith("mlp.")})
        config["target_modules"] = sorted({path.rpartition(".")[2] for path, _ in modules} -
                                          {path.rpartition(".")[2] for path in dense_mlp})
        config["target_parameters"] = [f"{path}.weight" for path in dense_mlp]
    if experts:
        _, hub_module, interleaved = expert_site(model.config)
        for stack in _sparse_stacks(model):  # each sparse stack's adapters at its own decoder layers
            params, expert_tensors = _expert_tensors(expert_lora_modules(model, stack.attr), stack.layers, interleaved,
                                                     hub_module)
            tensors.update(expert_tensors)
        # gate_up_proj's adapter has rank 2r; PEFT forbids rank patterns with rsLoRA, so the scale s = alpha / r
        # (or alpha / sqrt(r)) is written as a plain alpha for each rank
        doubled = {"gate_up_proj": 2 * first.r} if "gate_up_proj" in params else {}
        config.update(r=first.r, lora_alpha=first.scale * first.r, use_rslora=False, rank_pattern=doubled,
                      alpha_pattern={p: first.scale * r for p, r in doubled.items()},
                      target_parameters=[f"{hub_module}.{p}" for p in params] + config["target_parameters"])
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
    params = cfg.get("target_parameters") or []
    # a 2-D parameter of a projection (a dense layer's MLP beside experts): the projection's own LoRA
    dense = ([] if isinstance(params, str) else
             [m.group(1).rpartition(".")[2] for m in map(_DENSE_PARAM.fullmatch, params) if m])
    fused = [] if isinstance(params, str) else [t for t in params if not _DENSE_PARAM.fullmatch(t)]
    if isinstance(params, str) or sorted({t.rpartition(".")[-1] for t in fused} - set(_EXPERT_PARAMS)):
        raise CheckpointError(f"the adapter targets parameters {params!r}; jaxtune reads LoRA on a mixture of "
                              f"experts' {' and '.join(_EXPERT_PARAMS)} and on projections' weights only")
    cfg["target_parameters"] = [p for p in _EXPERT_PARAMS if any(t.rpartition(".")[-1] == p for t in fused)]
    targets = cfg.get("target_modules") or ([] if params else None)
    if isinstance(targets, str) or (not targets and not params):
        raise CheckpointError(f"target_modules={targets!r} is not a list of module names; jaxtune needs e.g. ['q_proj', 'v_proj']")
    names = sorted({t.split(".")[-1] for t in targets} | set(dense))
    unknown = [t for t in names if t not in ALL_TARGETS]
    if unknown:
        raise CheckpointError(f"adapter targets {', '.join(unknown)}, which jaxtune does not adapt; valid: {', '.join(ALL_TARGETS)}")
    cfg["target_modules"] = names
    return cfg


def _peft_scale(cfg: dict[str, Any], key: str, r: int) -> float:
    """PEFT's scaling of the adapter on module (or parameter) `key`: its alpha (alpha_pattern, else lora_alpha)
    over r, or over sqrt(r) with rsLoRA."""
    alpha = float(cfg.get("lora_alpha", 8))
    for pattern, value in (cfg.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", key):
            alpha = float(value)
            break
    return alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


def _load_expert_peft(model: CausalLM, cfg: dict[str, Any], adapter_dir: str) -> CausalLM:
    """A PEFT adapter with LoRA on a mixture of experts' fused parameters (`target_parameters`), the inverse of
    `_expert_tensors` for any adapter: gate_up_proj's rank-r' factors give gate and up each a rank-r' adapter
    (the same A; B's gate and up rows), down_proj's its own. Every adapter is padded with zeros to the largest
    rank and PEFT's per-module scale is folded into B, so one jaxtune scale of 1 reproduces PEFT's outputs. Module
    adapters (attention, a dense or shared MLP) are read by their module paths, so a shared expert's or Gemma 4's
    dense MLP's gate_proj is never taken for the routed experts'."""
    c = model.config
    if not c.num_experts:
        raise CheckpointError("the adapter adapts mixture-of-experts parameters; this model has no experts")
    order = cfg["target_parameters"]
    module_of = {module: p for p, module in _expert_param_modules(order).items()}
    sparse = sparse_layers(model.config)
    expert_attr, hub_module, interleaved = expert_site(c)
    paths = {(path, layer) for stack, layers in model.layer_stacks()
             for path in module_projections(model, stack, layers) for layer in stack.layers}
    factors: dict[tuple[str, int, str], np.ndarray] = {}
    with SafetensorsSource(adapter_dir) as source:
        for key in source.names():
            m, e = _KEY.fullmatch(key), _EXPERT_KEY.fullmatch(key)
            if m is not None and (m.group(2), int(m.group(1))) in paths:
                factors[(m.group(2), int(m.group(1)), m.group(3))] = np.asarray(source.get(key), np.float32)
            elif (e is not None and e.group(2) == hub_module and f"experts{e.group(3)}" in module_of
                  and int(e.group(1)) in sparse):
                factors[(module_of[f"experts{e.group(3)}"], int(e.group(1)), e.group(4))] = np.asarray(
                    source.get(key), np.float32)
            else:
                raise CheckpointError(f"adapter tensor {key} does not match this model ({c.num_layers} layers, "
                                      f"adapted: {', '.join([*cfg['target_modules'], *order])})")
    adapted = {path for path, _, _ in factors if path not in order}
    expected = {(path, i) for path, i in paths if path in adapted} | {(p, i) for p in order for i in sparse}
    missing = sorted((i, n, w) for n, i in expected for w in "AB" if (n, i, w) not in factors)
    if missing:
        i, n, w = missing[0]
        raise CheckpointError(f"adapter lacks layers.{i} {n} lora_{w}; the adapter is incomplete")
    experts = c.num_experts
    # (where: a module path's parent, or "experts"; projection name) -> {decoder layer: (A, B scaled)}
    adapters: dict[tuple[str, str], dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for path, i in sorted(expected):
        if path in order:
            continue
        a, b = factors[(path, i, "A")], factors[(path, i, "B")]
        site, _, name = path.rpartition(".")
        adapters.setdefault((site, name), {})[i] = (a, b * _peft_scale(cfg, f"model.layers.{i}.{path}", a.shape[0]))
    for i in sparse:
        for p in order:
            a, b = factors[(p, i, "A")], factors[(p, i, "B")]
            r = a.shape[0] // experts
            if a.shape[0] != r * experts or b.shape[1] != r * experts:
                raise CheckpointError(f"adapter {p} of layer {i} has A {a.shape} and B {b.shape}; this model has "
                                      f"{experts} experts: the adapter belongs to another model shape")
            a = a.reshape(experts, r, -1)  # PEFT: A [E * r, in] expert-major, B [out, r * E] rank-major
            b = b.reshape(b.shape[0], r, experts).transpose(2, 0, 1) * _peft_scale(
                cfg, f"model.layers.{i}.{hub_module}.{p}", r)
            if p == "down_proj":
                adapters.setdefault(("experts", "down_proj"), {})[i] = (a, b)
                continue
            gate, up = (b[:, 0::2], b[:, 1::2]) if interleaved else np.split(b, 2, axis=1)
            adapters.setdefault(("experts", "gate_proj"), {})[i] = (a, gate)
            adapters.setdefault(("experts", "up_proj"), {})[i] = (a, up)
    rank = max(a.shape[-2] for layers in adapters.values() for a, _ in layers.values())
    get_peft_model(model, r=rank, lora_alpha=rank, lora_dropout=float(cfg.get("lora_dropout", 0.0)),
                   target_modules=sorted({name for _, name in adapters}))
    for stack, stack_layers in model.layer_stacks():
        projections = module_projections(model, stack, stack_layers)
        for (site, name), layers in adapters.items():
            if site == "experts":
                proj = getattr(getattr(stack_layers, expert_attr), name) if has_experts(c, stack) else None
            else:
                proj = projections.get(f"{site}.{name}")
            if proj is None:
                continue
            want_a, want_b = proj.lora_a[...].shape, proj.lora_b[...].shape
            a_all, b_all = np.zeros(want_a, np.float32), np.zeros(want_b, np.float32)
            for j, i in enumerate(stack.layers):
                if i not in layers:  # a projection the adapter leaves alone in this kind of layer
                    continue
                a, b = layers[i]
                if a.shape[-1] != want_a[-1] or b.shape[-2] != want_b[-2]:
                    raise CheckpointError(f"adapter of {name} in layer {i} has A {a.shape} and B {b.shape}, this model "
                                          f"needs inputs of {want_a[-1]} and outputs of {want_b[-2]}: the adapter "
                                          "belongs to another model shape")
                a_all[j, ..., :a.shape[-2], :] = a
                b_all[j, ..., :b.shape[-1]] = b
            proj.lora_a.set_value(jnp.asarray(a_all))
            proj.lora_b.set_value(jnp.asarray(b_all))
    return model


def load_peft(model: CausalLM, adapter_dir: str | os.PathLike) -> CausalLM:
    """Adds a PEFT LoRA adapter to `model` (in place; returns it): any r, alpha, rsLoRA, subset of targets, and
    a mixture of experts' expert adapters on transformers' fused parameters."""
    adapter_dir = os.fspath(adapter_dir)
    cfg = _read_adapter_config(adapter_dir)
    if lora_modules(model) or expert_lora_modules(model):
        raise CheckpointError("the model already has LoRA adapters; load the adapter into a fresh base model")
    if cfg["target_parameters"]:
        return _load_expert_peft(model, cfg, adapter_dir)
    c = model.config
    r = int(cfg["r"])
    get_peft_model(model, r=r, lora_alpha=float(cfg.get("lora_alpha", 8)), lora_dropout=float(cfg.get("lora_dropout", 0.0)),
                   target_modules=cfg["target_modules"], use_rslora=bool(cfg.get("use_rslora", False)))
    modules = lora_modules(model)
    arrays = {id(proj): (proj, np.zeros(proj.lora_a[...].shape, np.float32), np.zeros(proj.lora_b[...].shape, np.float32))
              for proj, _ in modules.values()}
    adapted = sorted({path.rpartition(".")[2] for path, _ in modules})
    seen = set()
    with SafetensorsSource(adapter_dir) as source:
        for key in source.names():
            m = _KEY.fullmatch(key)
            if m is None:
                raise CheckpointError(f"adapter tensor {key!r} is not a LoRA A/B weight of a Llama-family layer")
            layer, path, which = int(m.group(1)), m.group(2), m.group(3)
            if (path, layer) not in modules:
                raise CheckpointError(f"adapter tensor {key} does not match this model ({c.num_layers} layers, "
                                      f"adapted: {', '.join(adapted)})")
            proj, j = modules[(path, layer)]
            target = arrays[id(proj)][1 if which == "A" else 2]
            value = np.asarray(source.get(key), np.float32)
            if value.shape != target.shape[1:]:
                raise CheckpointError(f"adapter tensor {key} has shape {value.shape}, this model needs "
                                      f"{target.shape[1:]}: the adapter belongs to another model shape")
            target[j] = value
            seen.add((layer, path, which))
    # every layer of each kind of module the adapter adapts (a same-named projection elsewhere, e.g. a shared
    # expert's gate_proj beside an adapted dense one, stays without LoRA: its B is zero)
    present = {path for _, path, _ in seen}
    missing = sorted((i, n, w) for n, i in modules for w in "AB" if n in present and (i, n, w) not in seen)
    if missing:
        i, n, w = missing[0]
        raise CheckpointError(f"adapter lacks layers.{i}.{n}.lora_{w}.weight; the adapter is incomplete")
    for proj, a, b in arrays.values():
        proj.lora_a.set_value(jnp.asarray(a))
        proj.lora_b.set_value(jnp.asarray(b))
    return model
