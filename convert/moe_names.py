"""The hub layout's names of a mixture of experts' tensors, which loading, merged export and GGUF both ways share:
Qwen3-MoE's `mlp.experts.E.gate_proj` / `up_proj` / `down_proj` and router `mlp.gate`, Mixtral's
`block_sparse_moe.experts.E.w1` (gate) / `w3` (up) / `w2` (down) and router `block_sparse_moe.gate`, and gpt-oss's
fused layout (every expert of a layer in one tensor per projection) with its biased `mlp.router`."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

# within a layer (after `model.layers.N.`): group 1 the expert, 2 its projection's hub name, 3 the tensor's suffix
EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight.*)")
# the router: Qwen3-MoE's / Mixtral's `gate.weight`, gpt-oss's `router.weight` and `router.bias`
ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.(?:gate\.weight|router\.(weight|bias))")
# Gemma 4's router beside its dense MLP (`router.proj.weight`, `router.scale`, `router.per_expert_scale`): jaxtune's
# `moe.router.weight` / `scale` / `per_expert_scale`
LAYER_ROUTER = re.compile(r"router\.(proj\.weight|scale|per_expert_scale)")
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def projection_name(hub_name: str) -> str:
    """jaxtune's projection (gate_proj, up_proj, down_proj) of an expert projection's hub name."""
    return {v: k for k, v in _MIXTRAL.items()}.get(hub_name, hub_name)


def expert_layout(model_type: str) -> tuple[str, dict[str, str]]:
    """(the MoE module, {gate_proj / up_proj / down_proj: the hub's per-expert name}) of a model type."""
    if model_type == "mixtral":
        return "block_sparse_moe", dict(_MIXTRAL)
    return "mlp", {name: name for name in _MIXTRAL}


# fused layouts: all of a layer's experts in one tensor per projection. gpt-oss (under `mlp.experts`): `gate_up_proj`
# [E, hidden, 2 * width] with gate and up interleaved (gate the even columns), `down_proj` [E, width, hidden],
# `*_bias` [E, out]. Gemma 4 (`experts` beside the layer's dense `mlp`): `gate_up_proj` [E, 2 * width, hidden], gate
# the first half, `down_proj` [E, hidden, width], no biases; jaxtune keeps those experts in the layer's `moe`.
FUSED = re.compile(r"(?P<module>mlp\.experts|experts)\.(?P<hub>gate_up_proj|down_proj)(?P<bias>_bias)?")


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    module: str  # the jaxtune module holding the experts' projections
    interleaved: bool  # gate and up in alternate columns (else gate the first half)
    transposed: bool  # stored [E, in, out] (else [E, out, in], as jaxtune holds them)


GPT_OSS, GEMMA4 = FusedLayout("mlp", True, True), FusedLayout("moe", False, False)
_LAYOUTS = {"mlp.experts": GPT_OSS, "experts": GEMMA4}
_FUSED_MODEL_TYPES = {"gpt_oss": GPT_OSS, "gemma4": GEMMA4, "gemma4_text": GEMMA4}


def hub_layout(module: str) -> FusedLayout:
    """The fused layout of a hub module name (`FUSED`'s `module` group)."""
    return _LAYOUTS[module]


def fused_layout(model_type: str) -> FusedLayout | None:
    """The family's fused expert layout, None where the hub stores an expert per tensor."""
    return _FUSED_MODEL_TYPES.get(model_type)


def stores_fused(model_type: str) -> bool:
    """Whether the hub stores the family's experts in a fused layout (gpt-oss, Gemma 4)."""
    return model_type in _FUSED_MODEL_TYPES


def fused_projections(hub_name: str) -> tuple[str, ...]:
    """jaxtune's projections that a fused tensor (`gate_up_proj` or `down_proj`) holds."""
    return ("gate_proj", "up_proj") if hub_name == "gate_up_proj" else ("down_proj",)


def fused_shape(hub_name: str, bias: bool, experts: int, hidden: int, width: int,
                layout: FusedLayout = GPT_OSS) -> tuple[int, ...]:
    """The hub's shape of a fused tensor."""
    out, inp = (2 * width, hidden) if hub_name == "gate_up_proj" else (hidden, width)
    if bias:
        return experts, out
    return (experts, inp, out) if layout.transposed else (experts, out, inp)


def split_fused(hub_name: str, bias: bool, array, layout: FusedLayout = GPT_OSS):
    """{projection: [E, out, in] weight (or [E, out] bias)} of a fused tensor, as jaxtune's expert stacks hold them."""
    if layout.transposed and not bias:
        array = array.swapaxes(-1, -2)
    if hub_name != "gate_up_proj":
        return {"down_proj": array}
    axis = -1 if bias else -2  # the output axis
    width = array.shape[axis] // 2
    if layout.interleaved:
        take = lambda start: array[..., start::2] if bias else array[..., start::2, :]  # noqa: E731
        return {"gate_proj": take(0), "up_proj": take(1)}
    if bias:
        return {"gate_proj": array[..., :width], "up_proj": array[..., width:]}
    return {"gate_proj": array[..., :width, :], "up_proj": array[..., width:, :]}


def join_fused(hub_name: str, bias: bool, parts: dict, layout: FusedLayout = GPT_OSS) -> np.ndarray:
    """The inverse of `split_fused`: the hub's fused tensor from {projection: [E, out, in] (or [E, out])}."""
    if hub_name != "gate_up_proj":
        out = np.asarray(parts["down_proj"], np.float32)
    else:
        gate, up = (np.asarray(parts[n], np.float32) for n in ("gate_proj", "up_proj"))
        axis = gate.ndim - 1 if bias else gate.ndim - 2
        if layout.interleaved:
            shape = list(gate.shape)
            shape[axis] *= 2
            out = np.empty(shape, np.float32)
            index = [slice(None)] * gate.ndim
            index[axis] = slice(0, None, 2)
            out[tuple(index)] = gate
            index[axis] = slice(1, None, 2)
            out[tuple(index)] = up
        else:
            out = np.concatenate([gate, up], axis=axis)
    if layout.transposed and not bias:
        out = out.swapaxes(-1, -2)
    return np.ascontiguousarray(out)
