"""A merged HF checkpoint: W + scale * B @ A for every adapted projection, loadable by transformers."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from convert.atomic import atomic_directory
from convert.jaxtune_format import write_shards
from convert.peft_io import lora_modules
from convert.safetensors_source import SafetensorsSource
from jaxtune import nf4
from jaxtune.errors import CheckpointError
from jaxtune.model import CausalLM, Linear
from jaxtune.qlora import LORA_TARGETS, PARENT_MODULE, LoRALinear, NF4Linear, projection

_DTYPES = {"bfloat16": jax.numpy.bfloat16, "float16": np.float16, "float32": np.float32}


def _layer(array: Any, i: int) -> np.ndarray:
    return np.asarray(array[i], np.float32)


def _base_weight(proj, i: int) -> np.ndarray:
    base = proj.base if isinstance(proj, LoRALinear) else proj
    if isinstance(base, NF4Linear):
        return np.asarray(nf4.dequantize(jax.tree.map(lambda a: a[i], base.weight_nf4)), np.float32)
    if isinstance(base, Linear):
        return _layer(base.weight[...], i)
    raise TypeError(f"unexpected projection {type(base).__name__}")


def _tensors(model: CausalLM, source: SafetensorsSource | None) -> Iterator[tuple[str, np.ndarray]]:
    """HF-named float32 tensors of the merged model, one at a time."""
    cfg = model.config

    def original(name: str, fallback) -> np.ndarray:
        return np.asarray(source.get(name), np.float32) if source is not None else fallback()

    yield "model.embed_tokens.weight", np.asarray(model.embed_tokens.weight[...], np.float32)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", _layer(model.layers.input_layernorm.weight[...], i)
        yield f"{p}.post_attention_layernorm.weight", _layer(model.layers.post_attention_layernorm.weight[...], i)
        if cfg.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", _layer(model.layers.self_attn.q_norm.weight[...], i)
            yield f"{p}.self_attn.k_norm.weight", _layer(model.layers.self_attn.k_norm.weight[...], i)
        for name in LORA_TARGETS:
            proj = projection(model, name)
            key = f"{p}.{PARENT_MODULE[name]}.{name}"
            w = original(f"{key}.weight", lambda: _base_weight(proj, i))
            if isinstance(proj, LoRALinear):
                a, b = _layer(proj.lora_a[...], i), _layer(proj.lora_b[...], i)
                w = w + np.float32(proj.scale) * (b @ a)
            yield f"{key}.weight", w
            base = proj.base if isinstance(proj, LoRALinear) else proj
            if base.bias is not None:
                yield f"{key}.bias", _layer(base.bias[...], i)
    yield "model.norm.weight", np.asarray(model.norm.weight[...], np.float32)
    if model.lm_head is not None:
        yield "lm_head.weight", np.asarray(model.lm_head.weight[...], np.float32)


def open_original(model: CausalLM, base: str | os.PathLike | None):
    """A tensor source of the ORIGINAL weights `base` (HF directory or .gguf) checked against the model, or None.

    None (no base) warns when the adapters would be merged onto dequantized NF4 weights, which loses quality.
    """
    if base is None:
        if any(isinstance((p.base if isinstance(p, LoRALinear) else p), NF4Linear)
               for p in (projection(model, n) for n in LORA_TARGETS)):
            warnings.warn("merging onto dequantized NF4 weights loses quality; pass base=<HF dir or .gguf of the "
                          "original weights> (--base) to merge onto them", stacklevel=3)
        return None
    from convert.jaxtune_format import is_jaxtune_checkpoint
    from convert.load import bnb_quantization, open_checkpoint

    base = os.fspath(base)
    if os.path.isdir(base) and (is_jaxtune_checkpoint(base) or bnb_quantization(base)):
        raise CheckpointError(f"base {base} holds NF4-quantized weights; pass the HF directory (or .gguf) of the "
                              "original weights, or omit it to merge onto the dequantized weights")
    base_cfg, source, _ = open_checkpoint(base)
    if base_cfg != model.config:
        source.close()
        raise CheckpointError(f"base {base} is not the checkpoint of this model (its config differs); "
                              "pass the directory or .gguf the model was converted from")
    return source


def save_merged(
    model: CausalLM,
    out_dir: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    tokenizer: Any = None,
    dtype: str = "bfloat16",
) -> None:
    """Writes a merged HF checkpoint (sharded safetensors, config.json, tokenizer) atomically.

    With `base` (the HF directory or .gguf of the ORIGINAL weights) the adapters are added onto those; without it, onto
    the dequantized NF4 weights, which loses quality (a warning says so).
    """
    if dtype not in _DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    if not lora_modules(model):
        raise CheckpointError("the model has no LoRA adapters to merge; call jaxtune.get_peft_model first")
    source = open_original(model, base)
    out_dtype = _DTYPES[dtype]
    try:
        with atomic_directory(out_dir) as tmp:
            tensors = ((name, value.astype(out_dtype)) for name, value in _tensors(model, source))
            write_shards(tmp, tensors, metadata={"format": "pt"})
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({**model.config.to_hf(), "torch_dtype": dtype, "dtype": dtype}, f, indent=2)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    finally:
        if source is not None:
            source.close()
