"""Qwen3.5 / Qwen3.6 (transformers' `qwen3_5`, its text-only `qwen3_5_text`): hybrid decoders whose layers are
Gated DeltaNet linear attention (`linear_attention`) or gated full attention (`full_attention`), as `layer_types`
(or `full_attention_interval`, every 4th by default) says.

What differs from the Llama block: the full-attention layers' q projection also yields a sigmoid output gate per
head, q/k norms, RoPE on the first `partial_rotary_factor` of each head; every RMSNorm scales by 1 + weight
(zero-centred weights); the linear-attention layers are jaxtune/models/blocks/gated_deltanet.py.
"""

from __future__ import annotations

from typing import Any

from jaxtune.errors import UnsupportedModelError

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: `text_config` of the published multimodal layout, or the dict itself."""
    if hf.get("model_type") not in ("qwen3_5", "qwen3_5_moe"):
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError(f"{hf['model_type']} config.json has no text_config; is it a complete config?")
    out = {**text, "model_type": hf["model_type"]}
    if "tie_word_embeddings" in hf:
        out.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
    return out


def fields(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The ModelConfig fields particular to Qwen3.5, refused in one line where they name no model jaxtune builds."""
    types = hf.get("layer_types")
    if types is None:
        interval = int(hf.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedModelError(
            f"qwen3_5 config.json has layer_types={types!r}; it must name {layers} layers, each one of "
            f"{', '.join(LAYER_TYPES)}")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("mrope_interleaved"):
        raise UnsupportedModelError("qwen3_5 with mrope_interleaved=true is not supported; text positions need the "
                                    "sectioned multimodal RoPE (mrope_interleaved false), as released")
    try:
        linear = dict(linear_num_key_heads=int(hf["linear_num_key_heads"]),
                      linear_num_value_heads=int(hf["linear_num_value_heads"]),
                      linear_key_head_dim=int(hf["linear_key_head_dim"]),
                      linear_value_head_dim=int(hf["linear_value_head_dim"]),
                      linear_conv_kernel_dim=int(hf.get("linear_conv_kernel_dim", 4)))
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"qwen3_5 config.json lacks a linear-attention size ({e}); is it complete?") from None
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise UnsupportedModelError(
            f"qwen3_5 config.json has linear_num_value_heads={linear['linear_num_value_heads']}, not a multiple of "
            f"linear_num_key_heads={linear['linear_num_key_heads']}")
    return dict(layer_types=tuple(types), partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
                attn_output_gate=True, norm_offset=True, **linear)


def hf_fields(cfg) -> dict[str, Any]:
    """config.json's Qwen3.5 entries for a ModelConfig (the text-only layout)."""
    return dict(layer_types=list(cfg.layer_types), linear_num_key_heads=cfg.linear_num_key_heads,
                linear_num_value_heads=cfg.linear_num_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
                linear_value_head_dim=cfg.linear_value_head_dim, linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
                attention_bias=cfg.qkv_bias)
