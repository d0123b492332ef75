"""Model configuration read from (and written back to) a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from jaxtune.errors import CheckpointError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen3_5", "qwen3_5_text",
                         "qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss", "gemma4", "gemma4_text")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen3_5_moe", "qwen3_5_moe_text", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder. Frozen so it can be a static jit argument."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # YaRN (rope_type "yarn"): the ramp's turn counts, whether its ends are rounded to whole pairs, and the scale of
    # cos and sin
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # generation_config.json's end-of-sequence ids (chat models list the turn end beside config.json's eos), which
    # transformers' generate and TRL stop at too
    generation_eos_token_ids: tuple[int, ...] = ()
    # mixture of experts (Qwen3-MoE, Mixtral): every layer's MLP is `num_experts` SwiGLU experts of width
    # `moe_intermediate_size`, each token routed to its top `num_experts_per_tok` (0 experts: a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1
    output_router_logits: bool = False  # transformers adds the load-balancing loss only when this is set
    router_aux_loss_coef: float = 0.0
    # Qwen3-MoE's layers with a dense MLP of width `intermediate_size` among the sparse ones (transformers'
    # `mlp_only_layers` and `decoder_sparse_step`, resolved to the layers they name)
    dense_mlp_layers: tuple[int, ...] = ()
    # Qwen3.5-MoE: a shared expert (a SwiGLU MLP of this width, its output scaled by a sigmoid gate) beside the
    # routed ones in every sparse layer; 0: none
    shared_expert_intermediate_size: int = 0
    # hybrid decoders (Qwen3.5): each layer's token mixer, "full_attention" or "linear_attention" (Gated DeltaNet);
    # empty: every layer full attention
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * this of each q/k head, the rest as it is
    attn_output_gate: bool = False  # the q projection also yields a per-head sigmoid gate on attention's output
    norm_offset: bool = False  # RMSNorm scales by 1 + weight (zero-centred weights)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # gpt-oss: a learned sink logit per head in attention's softmax; biases on the router and the experts; the
    # experts' clamped SwiGLU ("clamped_swiglu": (clip(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate,
    # limit)) instead of SiLU(gate) * up ("swiglu"). Sliding layers are those `layer_types` names "sliding_attention"
    attention_sinks: bool = False
    moe_bias: bool = False
    moe_activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Gemma 4: the decoder layer's structure ("llama": pre-norm; "gemma4": norms before and after attention and the
    # MLP, a learned per-layer output scale); the MLP's activation ("silu": SwiGLU, "gelu_pytorch_tanh": GeGLU);
    # embeddings times sqrt(hidden_size); logits soft-capped to c * tanh(logits / c)
    block: str = "llama"
    hidden_act: str = "silu"
    scale_embeddings: bool = False
    final_logit_softcapping: float | None = None
    # attention's softmax scale (None: 1 / sqrt(head_dim)); an RMSNorm without scale on every value head
    attention_scale: float | None = None
    v_norm: bool = False
    # the full-attention layers' own geometry where it differs from the sliding ones' (Gemma 4; 0: the same): head
    # size, KV heads, keys serving as values (no v_proj), and RoPE base and rotated fraction (proportional RoPE:
    # frequencies over the whole head, the pairs beyond the fraction unrotated)
    full_head_dim: int = 0
    full_num_kv_heads: int = 0
    full_k_eq_v: bool = False
    full_rope_theta: float = 0.0
    full_partial_rotary_factor: float = 1.0
    # Gemma 4's mixture of experts: the router reads the RMS-normalized hidden states times a learned scale, and
    # each chosen expert's weight is scaled per expert (moe/block.Router)
    router_scaled: bool = False
    # Gemma 4's small models: a per-layer input per token (`per_layer_dim` wide, from its own embedding table of
    # `per_layer_vocab_size` rows and a projection of the embeddings) added through each layer's gate and projection;
    # the last `num_kv_shared_layers` layers attend to an earlier layer's keys and values, their MLPs twice as wide
    # with `double_wide_mlp`
    per_layer_dim: int = 0
    per_layer_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads="
                f"{self.num_kv_heads}; fix the checkpoint's config.json"
            )

    def require_dense(self, what: str) -> None:
        """Refuses, in one line, what a mixture-of-experts model cannot do yet."""
        if self.num_experts:
            raise UnsupportedModelError(
                f"{what} is not supported yet for mixture-of-experts models ({self.model_type}); the run directory's "
                "checkpoint keeps the trained adapters (jaxtune train --resume continues from it)")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a transformers `config.json` dict (transformers 4.x and 5.x layouts)."""
        from jaxtune.models.families import gemma4, gpt_oss, qwen3_5

        hf = gemma4.text_config(qwen3_5.text_config(hf))
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported architecture model_type={model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        method = (hf.get("quantization_config") or {}).get("quant_method")
        if method == "mxfp4" and model_type not in gpt_oss.MODEL_TYPES:
            raise UnsupportedModelError(f"{model_type} checkpoints quantized with mxfp4 are not read; jaxtune reads "
                                        "MXFP4 experts of gpt_oss only: load the bf16 checkpoint")
        act = hf.get("hidden_act", "silu")
        if model_type in gemma4.MODEL_TYPES:
            act = hf.get("hidden_activation", "gelu_pytorch_tanh")
            if act != "gelu_pytorch_tanh":
                raise UnsupportedModelError(f"unsupported hidden_activation={act!r} in {model_type} config; only "
                                            "'gelu_pytorch_tanh' is implemented")
        elif act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act={act!r} in {model_type} config; only 'silu' is implemented")
        try:
            hidden = int(hf["hidden_size"])
            heads = int(hf["num_attention_heads"])
            layers = int(hf["num_hidden_layers"])
            inter = int(hf["intermediate_size"] if "intermediate_size" in hf or model_type not in qwen3_5.MODEL_TYPES
                        else hf.get("moe_intermediate_size", 0))
            vocab = int(hf["vocab_size"])
        except KeyError as e:
            raise CheckpointError(f"config.json lacks required key {e.args[0]!r}; is this a complete HF checkpoint?") from None
        rope = dict(hf.get("rope_parameters") or {})
        rope.update(hf.get("rope_scaling") or {})
        theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_type={rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        yarn = _yarn_fields(rope, model_type) if rope_type == "yarn" else {}
        sliding_window = None
        if model_type == "mistral":
            sliding_window = hf.get("sliding_window")
        elif model_type in ("qwen2", "qwen3", "qwen3_moe"):
            layer_types = hf.get("layer_types") or []
            if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
                raise UnsupportedModelError(
                    f"{model_type} with use_sliding_window=True is not supported; set use_sliding_window=false "
                    "(all released Qwen2/2.5/3 dense checkpoints use full attention)"
                )
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        moe = _moe_fields(model_type, hf, inter) if model_type in MOE_MODEL_TYPES else {}
        if model_type in qwen3_5.MODEL_TYPES:
            moe = {**moe, **qwen3_5.fields(hf, layers)}
        if model_type in gpt_oss.MODEL_TYPES:
            family = gpt_oss.fields(hf, layers)
            sliding_window = family.pop("sliding_window")
            moe = {**moe, **family}
        if model_type == "mixtral":
            sliding_window = hf.get("sliding_window")
        if model_type in gemma4.MODEL_TYPES:
            family = gemma4.fields(hf, layers)
            sliding_window, theta = family.pop("sliding_window"), family.pop("rope_theta")
            moe = {**moe, **family}
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_type=rope_type,
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            **yarn,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "qwen3", "qwen3_moe", *qwen3_5.MODEL_TYPES, *gpt_oss.MODEL_TYPES)
            and attention_bias,
            mlp_bias=model_type == "llama" and bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", *qwen3_5.MODEL_TYPES, *gemma4.MODEL_TYPES),
            sliding_window=int(sliding_window) if sliding_window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            **moe,
        )

    def to_hf(self) -> dict[str, Any]:
        """The transformers `config.json` dict for this model (written by converters and exporters)."""
        rope: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "linear":
            rope["factor"] = self.rope_factor
        elif self.rope_type == "yarn":
            rope.update(factor=self.rope_factor, original_max_position_embeddings=self.rope_original_max_position,
                        beta_fast=self.rope_beta_fast, beta_slow=self.rope_beta_slow, truncate=self.rope_truncate,
                        attention_factor=self.rope_attention_factor)
        elif self.rope_type == "llama3":
            rope.update(
                factor=self.rope_factor,
                low_freq_factor=self.rope_low_freq_factor,
                high_freq_factor=self.rope_high_freq_factor,
                original_max_position_embeddings=self.rope_original_max_position,
            )
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "gemma4": "Gemma4ForCausalLM", "gemma4_text": "Gemma4ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
        }
        if self.model_type == "llama":
            out.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type == "qwen2":
            out.update(use_sliding_window=False, sliding_window=None)
        if self.model_type in ("qwen3", "qwen3_moe"):
            out.update(attention_bias=self.qkv_bias, use_sliding_window=False, sliding_window=None)
        if self.model_type == "qwen3_moe":
            out.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                       norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=list(self.dense_mlp_layers))
        if self.model_type == "mixtral":
            out.update(num_local_experts=self.num_experts, sliding_window=self.sliding_window, router_jitter_noise=0.0)
        if self.model_type.startswith("qwen3_5"):  # written as the text-only layout transformers loads
            from jaxtune.models.families import qwen3_5

            rope["partial_rotary_factor"] = self.partial_rotary_factor
            out.update(model_type=self.model_type.removesuffix("_text") + "_text", rope_parameters=rope,
                       **qwen3_5.hf_fields(self))
            if self.num_experts:
                out.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                           shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        if self.num_experts:
            out.update(num_experts_per_tok=self.num_experts_per_tok, output_router_logits=self.output_router_logits,
                       router_aux_loss_coef=self.router_aux_loss_coef)
        if self.model_type == "gpt_oss":
            from jaxtune.models.families import gpt_oss

            out.update(rope_parameters=rope, **gpt_oss.hf_fields(self))
        if self.block == "gemma4":
            from jaxtune.models.families import gemma4

            out.pop("hidden_act")
            out.pop("rope_scaling")
            out.pop("rope_theta")
            out.update(**gemma4.hf_fields(self))
        return out


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's scale of cos and sin (so of the attention logits, squared): 0.1 ln(factor) + 1, or the ratio of two
    such terms where a config gives `mscale` and `mscale_all_dim`."""
    def term(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    return term(mscale) / term(mscale_all_dim) if mscale and mscale_all_dim else term(1.0)


def _yarn_fields(rope: dict[str, Any], model_type: str) -> dict[str, Any]:
    """YaRN's settings from a config's rope_parameters / rope_scaling, refused in one line where incomplete."""
    try:  # the factor and the original context are read with the other scalings' fields; YaRN needs both
        factor = float(rope["factor"])
        int(rope["original_max_position_embeddings"])
    except (KeyError, TypeError, ValueError) as e:
        raise UnsupportedModelError(f"{model_type} config.json's yarn RoPE lacks {e}; it needs factor and "
                                    "original_max_position_embeddings") from None
    explicit = rope.get("attention_factor")
    scale = (float(explicit) if explicit is not None
             else yarn_attention_factor(factor, rope.get("mscale"), rope.get("mscale_all_dim")))
    return dict(rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
                rope_truncate=bool(rope.get("truncate", True)), rope_attention_factor=scale)


def _moe_fields(model_type: str, hf: dict[str, Any], intermediate: int) -> dict[str, Any]:
    """The routing options of a Qwen3-MoE or Mixtral config.json, refused in one line where unsupported."""
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    top_k = hf.get("num_experts_per_tok")
    if not experts or not top_k or not 0 < int(top_k) <= int(experts):
        raise UnsupportedModelError(
            f"{model_type} config.json has num_experts={experts!r}, num_experts_per_tok={top_k!r}; a mixture of "
            "experts needs 1 <= num_experts_per_tok <= num_experts")
    dense: tuple[int, ...] = ()
    shared = 0
    if model_type == "qwen3_moe":
        dense = _dense_mlp_layers(hf)
        width, normalize = int(hf.get("moe_intermediate_size") or 0), bool(hf.get("norm_topk_prob", False))
    elif model_type == "gpt_oss":  # softmax over the top-k logits: the top-k of the softmax, renormalized
        width, normalize = intermediate, True
    elif model_type.startswith("qwen3_5_moe"):  # the router always renormalizes the top k; a shared expert
        width, normalize = int(hf.get("moe_intermediate_size") or 0), True
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        if shared <= 0:
            raise UnsupportedModelError(f"{model_type} config.json lacks shared_expert_intermediate_size; is it "
                                        "a complete config?")
    else:
        if float(hf.get("router_jitter_noise") or 0.0):
            raise UnsupportedModelError(
                f"mixtral with router_jitter_noise={hf['router_jitter_noise']} is not supported; set it to 0.0 "
                "(released Mixtral checkpoints use 0)")
        width, normalize = intermediate, True
    if width <= 0:
        raise UnsupportedModelError(f"{model_type} config.json lacks moe_intermediate_size; is it a complete config?")
    return dict(num_experts=int(experts), num_experts_per_tok=int(top_k), moe_intermediate_size=width,
                norm_topk_prob=normalize, output_router_logits=bool(hf.get("output_router_logits", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef") or 0.0), dense_mlp_layers=dense,
                shared_expert_intermediate_size=shared)


def _dense_mlp_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """The Qwen3-MoE layers whose MLP is dense, as transformers picks them: those in `mlp_only_layers`, and those
    whose index + 1 is not a multiple of `decoder_sparse_step`."""
    layers = int(hf.get("num_hidden_layers") or 0)
    step, listed = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise UnsupportedModelError(f"qwen3_moe config.json has decoder_sparse_step={step!r}; it must be an integer >= 1")
    if not isinstance(listed, list) or not all(isinstance(i, int) and 0 <= i < layers for i in listed):
        raise UnsupportedModelError(
            f"qwen3_moe config.json has mlp_only_layers={listed!r}; it must list layer indices below {layers}")
    dense = tuple(i for i in range(layers) if i in listed or (i + 1) % step)
    if len(dense) == layers:
        raise UnsupportedModelError(
            "qwen3_moe config.json makes every layer's MLP dense (mlp_only_layers / decoder_sparse_step); such a "
            "model has no experts: save it as qwen3")
    return dense


def load_hf_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Reads `model_dir/config.json` into a ModelConfig with clear errors for missing or bad files."""
    from jaxtune.io.jsonfile import read_json_file

    hf = read_json_file(
        os.path.join(model_dir, "config.json"),
        missing=f"{model_dir} has no config.json; point to a Hugging Face model directory or a .gguf file",
    )
    cfg = ModelConfig.from_hf(hf)
    eos = generation_eos_ids(model_dir)
    return dataclasses.replace(cfg, generation_eos_token_ids=eos) if eos else cfg


def generation_eos_ids(model_dir: str | os.PathLike) -> tuple[int, ...]:
    """The eos_token_id of `model_dir/generation_config.json` as a tuple (none: no file, or no ids in it); a file
    that is not JSON is named in one line."""
    from jaxtune.io.jsonfile import read_json_file

    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    data = read_json_file(path, missing="")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object; restore or re-create the file")
    eos = data.get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{path} has eos_token_id {eos!r}; it must be a token id or a list of them")
    return tuple(ids)


def generation_config_json(cfg: ModelConfig) -> dict[str, Any] | None:
    """generation_config.json's contents for a saved checkpoint (its eos ids), None where the model has none."""
    if not cfg.generation_eos_token_ids:
        return None
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.generation_eos_token_ids)}
