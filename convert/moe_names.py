"""The hub layout's names of a mixture of experts' tensors, which loading, merged export and GGUF both ways share:
Qwen3-MoE's `mlp.experts.E.gate_proj` / `up_proj` / `down_proj` and router `mlp.gate`, Mixtral's
`block_sparse_moe.experts.E.w1` (gate) / `w3` (up) / `w2` (down) and router `block_sparse_moe.gate`."""

from __future__ import annotations

import re

# within a layer (after `model.layers.N.`): group 1 the expert, 2 its projection's hub name, 3 the tensor's suffix
EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight.*)")
ROUTER = re.compile(r"(?:mlp|block_sparse_moe)\.gate\.weight")
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def projection_name(hub_name: str) -> str:
    """jaxtune's projection (gate_proj, up_proj, down_proj) of an expert projection's hub name."""
    return {v: k for k, v in _MIXTRAL.items()}.get(hub_name, hub_name)


def expert_layout(model_type: str) -> tuple[str, dict[str, str]]:
    """(the MoE module, {gate_proj / up_proj / down_proj: the hub's per-expert name}) of a model type."""
    if model_type == "mixtral":
        return "block_sparse_moe", dict(_MIXTRAL)
    return "mlp", {name: name for name in _MIXTRAL}
