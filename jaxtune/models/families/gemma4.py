"""Gemma 4 (transformers' `gemma4`, the published multimodal layout whose language model is read, and its text-only
`gemma4_text`): sliding-window and full-attention layers as `layer_types` says, each kind with its own RoPE.

What differs from the Llama block (jaxtune/models/blocks/gemma4_layer.py): norms before and after attention and
before and after the MLP, and a learned scalar on each layer's output; q/k norms and a scale-free norm on v, no
1/sqrt(d) on the attention logits; the full layers' own head size (`global_head_dim`), KV heads
(`num_global_key_value_heads`), keys serving as values (`attention_k_eq_v`) and proportional RoPE (frequencies
over the whole head, only the first `partial_rotary_factor` of the pairs turning); GeGLU MLPs; embeddings times
sqrt(hidden_size); tied embeddings; `final_logit_softcapping`.

The mixture-of-experts variant (`enable_moe_block`, 26B-A4B) adds routed GeGLU experts beside every layer's dense
MLP, each branch normed on its own before the sum; the router reads the layer's un-normed hidden states.

The small models (E2B, E4B) add a per-layer input per token (`hidden_size_per_layer_input`: its own embedding table
and a projection of the embeddings, added through each layer's gate and projection) and let the last
`num_kv_shared_layers` layers attend to an earlier layer's keys and values (their MLPs twice as wide with
`use_double_wide_mlp`); those models run their layers one by one (`CausalLM._decode_per_layer`).
"""

from __future__ import annotations

from typing import Any

from jaxtune.errors import UnsupportedModelError

MODEL_TYPES = ("gemma4", "gemma4_text")
LAYER_TYPES = ("sliding_attention", "full_attention")


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings: `text_config` of the published multimodal layout, or the dict itself."""
    if hf.get("model_type") != "gemma4":
        return hf
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError("gemma4 config.json has no text_config; is it a complete config?")
    out = {**text, "model_type": "gemma4"}
    if "tie_word_embeddings" in hf:
        out.setdefault("tie_word_embeddings", hf["tie_word_embeddings"])
    return out


def fields(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The ModelConfig fields particular to Gemma 4, refused in one line where they name no model jaxtune builds."""
    model_type = hf["model_type"]
    if hf.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(f"{model_type} with use_bidirectional_attention='all' is not a causal decoder; "
                                    "jaxtune fine-tunes causal language models")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise UnsupportedModelError(f"{model_type} config.json has layer_types={types!r}; it must name {layers} "
                                    f"layers, each one of {', '.join(LAYER_TYPES)}")
    rope = hf.get("rope_parameters") or {}
    sliding = rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0}
    full = rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                          "rope_theta": 1_000_000.0}
    for kind, params in (("sliding_attention", sliding), ("full_attention", full)):
        if params.get("rope_type", "default") not in ("default", "proportional") or float(params.get("factor", 1.0)) != 1:
            raise UnsupportedModelError(f"{model_type} {kind} RoPE {params!r} is not supported; jaxtune reads "
                                        "default and proportional RoPE without scaling factors")
    if sliding.get("rope_type", "default") != "default" or float(sliding.get("partial_rotary_factor", 1.0)) != 1:
        raise UnsupportedModelError(f"{model_type} sliding-attention RoPE {sliding!r} is not supported; it must rotate "
                                    "the whole head (rope_type default)")
    head_dim = int(hf.get("head_dim") or 256)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    full_head, full_kv = _full_geometry(hf, types, head_dim, k_eq_v)
    window = hf.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise UnsupportedModelError(f"{model_type} config.json has sliding layers but no sliding_window; is it complete?")
    moe = _moe_fields(hf) if hf.get("enable_moe_block") else {}
    small = _small_model_fields(hf, types)
    softcap = hf.get("final_logit_softcapping")
    full_rotated = float(full.get("partial_rotary_factor", 1.0))
    return dict(layer_types=tuple(types), sliding_window=int(window) if window else None,
                rope_theta=float(sliding.get("rope_theta", 10_000.0)), block="gemma4",
                hidden_act="gelu_pytorch_tanh", scale_embeddings=True,
                final_logit_softcapping=float(softcap) if softcap else None, attention_scale=1.0, v_norm=True,
                full_head_dim=full_head, full_num_kv_heads=full_kv, full_k_eq_v=k_eq_v,
                full_rope_theta=float(full.get("rope_theta", 1_000_000.0)),
                full_partial_rotary_factor=full_rotated if full.get("rope_type") == "proportional" else 1.0, **moe,
                **small)


def _small_model_fields(hf: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """E2B / E4B: the per-layer inputs and the layers sharing keys and values."""
    per_layer = int(hf.get("hidden_size_per_layer_input") or 0)
    shared = int(hf.get("num_kv_shared_layers") or 0)
    if shared:
        first = len(types) - shared
        if not 0 < first < len(types) or set(types[first:]) - set(types[:first]):
            raise UnsupportedModelError(
                f"{hf['model_type']} config.json has num_kv_shared_layers={shared} of {len(types)} layers; every "
                "sharing layer needs an earlier layer of its type to share with")
    return dict(per_layer_dim=per_layer,
                per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input") or hf["vocab_size"]) if per_layer else 0,
                num_kv_shared_layers=shared, double_wide_mlp=bool(hf.get("use_double_wide_mlp")) and shared > 0)


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The mixture of experts beside every layer's dense MLP (26B-A4B): softmax over all experts, the top k
    renormalized, then scaled per expert; GeGLU experts."""
    experts, top_k, width = hf.get("num_experts"), hf.get("top_k_experts"), hf.get("moe_intermediate_size")
    if not experts or not top_k or not width or not 0 < int(top_k) <= int(experts):
        raise UnsupportedModelError(
            f"{hf['model_type']} config.json has enable_moe_block with num_experts={experts!r}, top_k_experts="
            f"{top_k!r}, moe_intermediate_size={width!r}; it needs all three, 1 <= top_k_experts <= num_experts")
    return dict(num_experts=int(experts), num_experts_per_tok=int(top_k), moe_intermediate_size=int(width),
                norm_topk_prob=True, moe_activation="geglu", router_scaled=True)


def _full_geometry(hf: dict[str, Any], types: list[str], head_dim: int, k_eq_v: bool) -> tuple[int, int]:
    """(head size, KV heads; 0: the model's) of the full-attention layers: transformers 5's `per_layer_config`
    ({layer: overrides}, the same for every full layer and none for the sliding ones), or the published configs'
    `global_head_dim` / `num_global_key_value_heads` (the latter only with attention_k_eq_v, as transformers reads
    it)."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        kv = int(hf.get("num_global_key_value_heads") or 0) if k_eq_v else 0
        return int(hf.get("global_head_dim") or 512), kv
    if not isinstance(per_layer, dict):
        raise UnsupportedModelError(f"{hf['model_type']} config.json has per_layer_config={per_layer!r}; it must map "
                                    "layer indices to their overrides")
    overrides = {int(layer): dict(v) for layer, v in per_layer.items()}
    full = [overrides.get(i, {}) for i, kind in enumerate(types) if kind == "full_attention"]
    if any(overrides.get(i) for i, kind in enumerate(types) if kind != "full_attention") or any(
            o != full[0] or set(o) - {"head_dim", "num_key_value_heads"} for o in full):
        raise UnsupportedModelError(
            f"{hf['model_type']} config.json's per_layer_config {per_layer!r} is not supported; jaxtune reads one "
            "head_dim / num_key_value_heads override shared by every full-attention layer")
    first = full[0] if full else {}
    kv = int(first.get("num_key_value_heads", 0))
    return int(first.get("head_dim", head_dim)), 0 if kv == int(hf.get("num_key_value_heads") or 0) else kv


def hf_fields(cfg) -> dict[str, Any]:
    """config.json's Gemma 4 entries for a ModelConfig (the text-only layout transformers loads)."""
    full_rope = {"rope_type": "proportional", "partial_rotary_factor": cfg.full_partial_rotary_factor,
                 "rope_theta": cfg.full_rope_theta}
    return dict(model_type="gemma4_text", layer_types=list(cfg.layer_types), sliding_window=cfg.sliding_window,
                hidden_activation=cfg.hidden_act, final_logit_softcapping=cfg.final_logit_softcapping,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                                 "full_attention": full_rope},
                per_layer_config={i: {"head_dim": cfg.full_head_dim, "num_key_value_heads": cfg.full_num_kv_heads
                                      or cfg.num_kv_heads} for i, kind in enumerate(cfg.layer_types)
                                  if kind == "full_attention"},
                attention_k_eq_v=cfg.full_k_eq_v, hidden_size_per_layer_input=cfg.per_layer_dim,
                vocab_size_per_layer_input=cfg.per_layer_vocab_size or cfg.vocab_size,
                num_kv_shared_layers=cfg.num_kv_shared_layers, use_double_wide_mlp=cfg.double_wide_mlp,
                enable_moe_block=bool(cfg.num_experts), attention_bias=cfg.qkv_bias,
                **(dict(num_experts=cfg.num_experts, top_k_experts=cfg.num_experts_per_tok,
                        moe_intermediate_size=cfg.moe_intermediate_size) if cfg.num_experts else {}))
