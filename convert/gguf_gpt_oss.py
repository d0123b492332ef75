"""gpt-oss as llama.cpp's `gpt-oss` architecture: what the GGUF writer (convert/gguf_export.py) needs beyond the
Llama-like families, as llama.cpp's own converter lays it out.

- Tensors: the experts' fused, interleaved gate/up [E, hidden, 2·inter] (HF's in-by-out layout) split into
  `ffn_gate_exps` and `ffn_up_exps` [E, inter, hidden] (even and odd columns), `ffn_down_exps` [E, hidden, inter],
  their biases split the same way, the router (`ffn_gate_inp`, weight and bias), the attention sinks
  (`attn_sinks.weight`), q/k/v/o with their biases in rotate-half (NEOX) order as they are, and the post-attention
  norm (`post_attention_norm`).
- Keys: the sliding window and each layer's kind (`sliding_window_pattern`, one flag per layer), the experts' width,
  and YaRN's factor, original context and ramp (llama.cpp rounds the ramp's ends to whole pairs; gpt-oss's
  transformers config does not; on the test models llama.cpp's logits of the file are within 4.9e-4 of
  transformers' of the merged checkpoint with YaRN, 3.1e-4 without, its KV cache in f16).
- llama.cpp computes gpt-oss's clamped SwiGLU with alpha 1.702 and limit 7.0 and the softmax over the selected
  router logits; a model with other constants is refused.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import numpy as np

from convert.merged import MergedTensor
from jaxtune.errors import UnsupportedModelError
from jaxtune.models.config import ModelConfig

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURE = "gpt-oss"
GGUF_TYPES = ("bf16", "f16", "q8_0", "f32")  # every matrix one type; llama-quantize's mixes for gpt-oss are its own

_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias",
          **{f"self_attn.{p}_proj.{kind}": f"attn_{g}.{kind}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                            ("o", "output"))
             for kind in ("weight", "bias")}}


def check(cfg: ModelConfig) -> None:
    """Refuses, in one line, a gpt-oss model llama.cpp's `gpt-oss` would not compute as jaxtune does."""
    if cfg.swiglu_alpha != 1.702 or cfg.swiglu_limit != 7.0:
        raise UnsupportedModelError(
            f"llama.cpp's gpt-oss computes the experts' SwiGLU with alpha 1.702 and limit 7.0, this model with "
            f"{cfg.swiglu_alpha} and {cfg.swiglu_limit}; export --merged instead")
    if cfg.rope_type not in ("default", "yarn"):
        raise UnsupportedModelError(f"llama.cpp's gpt-oss reads plain or YaRN RoPE, not {cfg.rope_type!r}; "
                                    "export --merged instead")
    if cfg.rope_type == "yarn" and not math.isclose(cfg.rope_attention_factor, 0.1 * math.log(cfg.rope_factor) + 1):
        raise UnsupportedModelError(
            f"llama.cpp's YaRN scales attention by 0.1·ln(factor) + 1, this model by {cfg.rope_attention_factor}; "
            "export --merged instead")


def add_hyperparameters(writer: Any, cfg: ModelConfig) -> None:
    """The keys llama.cpp's gpt-oss reads beyond the common ones (convert/gguf_export.py writes those)."""
    import gguf

    writer.add_sliding_window(cfg.sliding_window or cfg.max_position_embeddings)
    writer.add_array(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=ARCHITECTURE),
                     [kind == "sliding_attention" for kind in cfg.layer_types])
    if cfg.rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(cfg.rope_factor)
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_max_position)
        writer.add_rope_scaling_yarn_beta_fast(cfg.rope_beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(cfg.rope_beta_slow)


def _columns(tensor: MergedTensor, start: int, transpose: bool) -> np.ndarray:
    """Every other column of a fused gate/up tensor from `start` (0: gate, 1: up), as [E, out, in] when
    `transpose`."""
    w = tensor.compute()[..., start::2]
    return np.ascontiguousarray(w.transpose(0, 2, 1) if transpose else w)


def _transposed(tensor: MergedTensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.compute().transpose(0, 2, 1))


def gguf_tensors(merged: list[MergedTensor]) -> list[MergedTensor]:
    """The merged HF tensors under llama.cpp's gpt-oss names and layouts."""
    out = []
    for t in merged:
        if t.name in _TOP:
            out.append(MergedTensor(_TOP[t.name], t.shape, t.compute))
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", t.name)
        if m is None:
            raise UnsupportedModelError(f"tensor {t.name} has no llama.cpp gpt-oss counterpart")
        blk, rest = f"blk.{m.group(1)}", m.group(2)
        if rest in _LAYER:
            out.append(MergedTensor(f"{blk}.{_LAYER[rest]}", t.shape, t.compute))
        elif rest == "mlp.experts.gate_up_proj":  # [E, hidden, 2 inter], gate in the even columns
            e, hidden, both = t.shape
            for start, proj in ((0, "gate"), (1, "up")):
                out.append(MergedTensor(f"{blk}.ffn_{proj}_exps.weight", (e, both // 2, hidden),
                                        functools.partial(_columns, t, start, True)))
        elif rest == "mlp.experts.gate_up_proj_bias":
            e, both = t.shape
            for start, proj in ((0, "gate"), (1, "up")):
                out.append(MergedTensor(f"{blk}.ffn_{proj}_exps.bias", (e, both // 2),
                                        functools.partial(_columns, t, start, False)))
        elif rest == "mlp.experts.down_proj":  # [E, inter, hidden] in-by-out
            e, inter, hidden = t.shape
            out.append(MergedTensor(f"{blk}.ffn_down_exps.weight", (e, hidden, inter),
                                    functools.partial(_transposed, t)))
        elif rest == "mlp.experts.down_proj_bias":
            out.append(MergedTensor(f"{blk}.ffn_down_exps.bias", t.shape, t.compute))
        else:
            raise UnsupportedModelError(f"tensor {t.name} has no llama.cpp gpt-oss counterpart")
    return out
