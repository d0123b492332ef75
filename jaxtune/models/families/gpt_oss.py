"""gpt-oss (transformers' `gpt_oss`): a mixture of experts in every layer, attention with per-head sinks.

What differs from the Llama block: q/k/v/o biases; a learned sink logit per head in the softmax's denominator;
sliding-window (`sliding_window`, 128) and full layers alternating as `layer_types` says; YaRN RoPE; a router with
a bias whose top-k logits are softmaxed (the renormalized top-k of the full softmax); experts with biases and the
clamped SwiGLU `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`, g = min(gate, limit). The hub stores each
layer's experts fused: `gate_up_proj` [E, hidden, 2 * width] with gate and up interleaved, `down_proj`
[E, width, hidden] (split at load: convert/moe_names.py). The published checkpoints store those two in MXFP4
(`*_blocks` / `*_scales`, convert/mxfp4_source.py), dequantized at load.
"""

from __future__ import annotations

from typing import Any

from jaxtune.errors import UnsupportedModelError

MODEL_TYPES = ("gpt_oss",)
LAYER_TYPES = ("sliding_attention", "full_attention")


def fields(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The ModelConfig fields particular to gpt-oss, refused in one line where they name no model jaxtune builds."""
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"gpt_oss config.json has layer_types={types!r}; it must name {layers} layers, each one of "
            f"{', '.join(LAYER_TYPES)}")
    window = hf.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise UnsupportedModelError("gpt_oss config.json has sliding layers but no sliding_window; is it complete?")
    return dict(layer_types=tuple(types), sliding_window=int(window) if window else None, attention_sinks=True,
                moe_bias=True, moe_activation="clamped_swiglu", swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0)))


def hf_fields(cfg) -> dict[str, Any]:
    """config.json's gpt-oss entries for a ModelConfig."""
    return dict(layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window, attention_bias=cfg.qkv_bias,
                num_local_experts=cfg.num_experts, experts_per_token=cfg.num_experts_per_tok,
                num_experts_per_tok=cfg.num_experts_per_tok, swiglu_alpha=cfg.swiglu_alpha,
                swiglu_limit=cfg.swiglu_limit, intermediate_size=cfg.moe_intermediate_size,
                router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=cfg.output_router_logits)
