"""The hub layout's names of a mixture of experts' tensors, which loading, merged export and GGUF both ways share:
Qwen3-MoE's `mlp.experts.E.gate_proj` / `up_proj` / `down_proj` and router `mlp.gate`, Mixtral's
`block_sparse_moe.experts.E.w1` (gate) / `w3` (up) / `w2` (down) and router `block_sparse_moe.gate`, and gpt-oss's
fused layout (every expert of a layer in one tensor per projection) with its biased `mlp.router`."""

from __future__ import annotations

import re

import numpy as np

# within a layer (after `model.layers.N.`): group 1 the expert, 2 its projection's hub name, 3 the tensor's suffix
EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight.*)")
# the router: Qwen3-MoE's / Mixtral's `gate.weight`, gpt-oss's `router.weight` and `router.bias`
ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.(?:gate\.weight|router\.(weight|bias))")
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def projection_name(hub_name: str) -> str:
    """jaxtune's projection (gate_proj, up_proj, down_proj) of an expert projection's hub name."""
    return {v: k for k, v in _MIXTRAL.items()}.get(hub_name, hub_name)


def expert_layout(model_type: str) -> tuple[str, dict[str, str]]:
    """(the MoE module, {gate_proj / up_proj / down_proj: the hub's per-expert name}) of a model type."""
    if model_type == "mixtral":
        return "block_sparse_moe", dict(_MIXTRAL)
    return "mlp", {name: name for name in _MIXTRAL}


# gpt-oss's fused layout: all of a layer's experts in one tensor per projection, `gate_up_proj` [E, hidden, 2 * width]
# with gate and up interleaved (gate the even columns), `down_proj` [E, width, hidden], `*_bias` [E, out]
FUSED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
FUSED_MODEL_TYPES = ("gpt_oss",)


def stores_fused(model_type: str) -> bool:
    """Whether the hub stores the family's experts in the fused, interleaved layout (gpt-oss)."""
    return model_type in FUSED_MODEL_TYPES


def fused_projections(hub_name: str) -> tuple[str, ...]:
    """jaxtune's projections that a fused tensor (`gate_up_proj` or `down_proj`) holds."""
    return ("gate_proj", "up_proj") if hub_name == "gate_up_proj" else ("down_proj",)


def fused_shape(hub_name: str, bias: bool, experts: int, hidden: int, width: int) -> tuple[int, ...]:
    """The hub's shape of a fused tensor."""
    if hub_name == "gate_up_proj":
        return (experts, 2 * width) if bias else (experts, hidden, 2 * width)
    return (experts, hidden) if bias else (experts, width, hidden)


def split_fused(hub_name: str, bias: bool, array):
    """{projection: [E, out, in] weight (or [E, out] bias)} of a fused tensor, as jaxtune's expert stacks hold them."""
    if hub_name == "gate_up_proj":
        parts = {"gate_proj": array[..., 0::2], "up_proj": array[..., 1::2]}
    else:
        parts = {"down_proj": array}
    return parts if bias else {name: part.swapaxes(-1, -2) for name, part in parts.items()}


def join_fused(hub_name: str, bias: bool, parts: dict) -> np.ndarray:
    """The inverse of `split_fused`: the hub's fused tensor from {projection: [E, out, in] (or [E, out])}."""
    if not bias:
        parts = {name: part.swapaxes(-1, -2) for name, part in parts.items()}
    if hub_name != "gate_up_proj":
        return np.ascontiguousarray(parts["down_proj"])
    gate, up = parts["gate_proj"], parts["up_proj"]
    out = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), np.float32)
    out[..., 0::2], out[..., 1::2] = gate, up
    return out
