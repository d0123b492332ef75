"""GGUF export of a fine-tuned model for llama.cpp / Ollama: the merged weights as a GGUF of llama.cpp's `llama`
(Llama, Mistral, Mixtral), `qwen3`, `qwen3moe` or `gpt-oss` architecture (what gpt-oss adds: convert/gguf_gpt_oss.py).

The tensors are those of the merged HF checkpoint (LoRA added onto the original weights when they are
given), renamed to llama.cpp's names; for `llama`, q/k rows permuted into llama.cpp's interleaved-RoPE order
(the inverse of what the GGUF importer undoes; Qwen3's rotate-half RoPE is llama.cpp's NEOX order, kept as it is);
a mixture of experts' per-expert matrices stacked into one [experts, out, in] tensor per layer and projection, as
llama.cpp reads them. Hyperparameters and the tokenizer (vocabulary, merges or
scores, special ids, chat template) go into the metadata. Written with the `gguf` package's writer and
quantizers to a temp file beside the output, renamed when complete: the tensor table first, then each tensor
computed and written alone, so the export holds one tensor in host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tempfile
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from convert.atomic import check_writable, plain_permissions
from convert.gguf_source import _LAYER_NAMES, _TOP_NAMES
from convert.gguf_tokenizer import gguf_tokenizer_fields
from convert import gguf_gpt_oss, moe_names
from convert.merged import MergedTensor, merged_tensors, open_original
from jaxtune.models.config import ModelConfig
from jaxtune.errors import CheckpointError, UnsupportedModelError
from jaxtune.models.causal_lm import CausalLM
from jaxtune.quant import quantize_q4_0, quantize_q4_k, quantize_q5_k, quantize_q6_k
from jaxtune.quant.weighted import WEIGHTED_FORMATS, quantize_weighted
from jaxtune.models.rope import inverse_frequencies, unscaled_inverse_frequencies

GGUF_TYPES = ("bf16", "f16", "q8_0", "q6_k", "q4_k_m", "q4_0", "f32")
# model type -> llama.cpp's architecture it is written as
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen3": "qwen3",
                      "qwen3_moe": "qwen3moe", **dict.fromkeys(gguf_gpt_oss.MODEL_TYPES, gguf_gpt_oss.ARCHITECTURE)}
GGUF_MODEL_TYPES = tuple(GGUF_ARCHITECTURES)
_GGUF_NAMES = {hf: gguf for gguf, hf in _TOP_NAMES.items()}
_GGUF_LAYER_NAMES = {**{hf: gguf for gguf, hf in _LAYER_NAMES.items()}, "self_attn.q_norm": "attn_q_norm",
                     "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
                     "block_sparse_moe.gate": "ffn_gate_inp"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's tensor name for an HF Llama tensor name (inverse of the importer's mapping)."""
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    prefix, _, rest = hf_name.partition("model.layers.")
    index, _, module = rest.partition(".")
    module, _, kind = module.rpartition(".")
    if prefix or not index.isdigit() or module not in _GGUF_LAYER_NAMES:
        raise UnsupportedModelError(f"tensor {hf_name} has no llama.cpp counterpart; GGUF export covers "
                                    f"{', '.join(GGUF_MODEL_TYPES)} models")
    return f"blk.{index}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def _stacked_name(hf_name: str) -> str | None:
    """llama.cpp's name of the [experts, out, in] stack an expert's merged matrix goes into, None for others."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    expert = moe_names.EXPERT.fullmatch(m.group(2)) if m else None
    if expert is None:
        return None
    return f"blk.{m.group(1)}.ffn_{moe_names.projection_name(expert.group(2)).removesuffix('_proj')}_exps.weight"


def _stack(parts: list[MergedTensor]) -> np.ndarray:
    return np.stack([p.compute() for p in parts])


def _gguf_tensors(merged: list[MergedTensor], cfg: ModelConfig) -> list[MergedTensor]:
    """The merged HF tensors under llama.cpp's names, each layer's experts stacked per projection."""
    if cfg.model_type in gguf_gpt_oss.MODEL_TYPES:
        return gguf_gpt_oss.gguf_tensors(merged)
    groups: dict[str, list[MergedTensor]] = {}  # llama.cpp name -> its merged tensors (several for a stack)
    for t in merged:
        groups.setdefault(_stacked_name(t.name) or gguf_name(t.name), []).append(t)
    return [MergedTensor(name, parts[0].shape, parts[0].compute) if not name.endswith("_exps.weight") else
            MergedTensor(name, (len(parts), *parts[0].shape), functools.partial(_stack, parts))
            for name, parts in groups.items()]


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotate_half halves -> interleaved pairs), per head; inverse of unpermute_qk."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_factors(cfg: ModelConfig) -> np.ndarray:
    """llama.cpp's `rope_freqs` for llama3 RoPE scaling: per-pair divisors of the unscaled frequencies."""
    return (unscaled_inverse_frequencies(cfg.rope_theta, cfg.head_dim) / inverse_frequencies(cfg)).astype(np.float32)


def check_gguf_output(out_path: str | os.PathLike) -> str:
    """The output path as a string, or a clear error when it is not a new .gguf file."""
    out_path = os.fspath(out_path)
    if not out_path.endswith(".gguf"):
        raise CheckpointError(f"{out_path} does not end in .gguf; name the output file OUT.gguf")
    if os.path.exists(out_path):
        raise CheckpointError(f"{out_path} already exists; choose a new output file or delete it first")
    check_writable(out_path, "GGUF file")
    return out_path


IMATRIX_TYPES = ("q4_0", "q4_k_m", "q6_k")  # the exported types whose quantizers an importance matrix weights


def _importance(model: CausalLM, gguf_type: str, imatrix: Any):
    """The importance matrix `imatrix` names (read from llama.cpp's file where it is a path), checked against the
    export; None without one."""
    if imatrix is None:
        return None
    from convert.imatrix import ImportanceMatrix, check_importance_model

    if gguf_type not in IMATRIX_TYPES:
        raise CheckpointError(f"an importance matrix weights the {', '.join(IMATRIX_TYPES)} quantizers; "
                              f"--gguf-type {gguf_type} does not use one (drop --gguf-imatrix or pick one of those)")
    check_importance_model(model)
    return imatrix if isinstance(imatrix, ImportanceMatrix) else ImportanceMatrix.load(imatrix)


def _importance_weights(importance, tensors: list[MergedTensor]) -> dict[str, np.ndarray]:
    """Each GGUF tensor's error weights from the importance matrix, checked: one per input column."""
    if importance is None:
        return {}
    weights = {}
    for t in tensors:
        w = importance.weights(t.name)
        if w is None:
            continue
        if w.shape != (t.shape[-1],):
            raise CheckpointError(f"the importance matrix has {w.shape[0]} weights for {t.name}, whose rows have "
                                  f"{t.shape[-1]}: it was computed for another model")
        weights[t.name] = w
    return weights


def _check_exportable(model: CausalLM, gguf_type: str) -> ModelConfig:
    cfg = model.config
    check_gguf_model(cfg)
    if gguf_type not in GGUF_TYPES:
        raise CheckpointError(f"unknown GGUF type {gguf_type!r}; choose one of: {', '.join(GGUF_TYPES)}")
    if cfg.model_type in gguf_gpt_oss.MODEL_TYPES and gguf_type not in gguf_gpt_oss.GGUF_TYPES:
        raise CheckpointError(f"a gpt-oss GGUF is written as {', '.join(gguf_gpt_oss.GGUF_TYPES)}, not {gguf_type}: "
                              "llama-quantize's 4- and 6-bit mix for gpt-oss is its own; write q8_0 or bf16 and "
                              "quantize that file with llama-quantize")
    return cfg


def check_gguf_model(cfg: ModelConfig) -> None:
    """Refuses, in one line, a model llama.cpp's architectures written here would not compute as jaxtune does."""
    if cfg.model_type not in GGUF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"GGUF export covers {', '.join(GGUF_MODEL_TYPES)} models, not {cfg.model_type!r}; export --merged and "
            "convert that directory with llama.cpp's convert_hf_to_gguf.py")
    if cfg.model_type in gguf_gpt_oss.MODEL_TYPES:
        return gguf_gpt_oss.check(cfg)
    if cfg.num_experts and not cfg.norm_topk_prob:
        raise UnsupportedModelError(
            f"llama.cpp's {GGUF_ARCHITECTURES[cfg.model_type]} renormalizes each token's top-{cfg.num_experts_per_tok} "
            "routing weights, but this model's config has norm_topk_prob=false; export --merged instead")
    if cfg.dense_mlp_layers:
        raise UnsupportedModelError(
            f"llama.cpp's {GGUF_ARCHITECTURES[cfg.model_type]} gives every layer experts, but layers "
            f"{list(cfg.dense_mlp_layers)} of this model have a dense MLP; export --merged instead")
    if cfg.rope_type == "yarn":
        raise UnsupportedModelError(
            "GGUF export does not write YaRN RoPE scaling yet (llama.cpp reads it from keys this writer lacks); "
            "export --merged and convert that directory with llama.cpp's convert_hf_to_gguf.py")
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise UnsupportedModelError("GGUF export covers Llama models without projection biases; export --merged instead")
    if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
        raise UnsupportedModelError(
            f"the model attends through a {cfg.sliding_window}-token sliding window, which llama.cpp's llama "
            "architecture does not apply; export --merged instead")


def _add_hyperparameters(writer: Any, cfg: ModelConfig, name: str, file_type: int) -> None:
    import gguf

    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.num_experts:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(cfg.rope_factor)
    elif cfg.rope_type == "llama3":  # the factors go in the rope_freqs tensor; this key makes them read back as given
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original_max_position)
    if cfg.model_type in gguf_gpt_oss.MODEL_TYPES:
        gguf_gpt_oss.add_hyperparameters(writer, cfg)


def _add_tokenizer(writer: Any, tokenizer: Any, cfg: ModelConfig) -> None:
    fields = gguf_tokenizer_fields(tokenizer, cfg.vocab_size)
    writer.add_tokenizer_model(fields.pop("tokenizer.ggml.model"))
    if "tokenizer.ggml.pre" in fields:
        writer.add_tokenizer_pre(fields.pop("tokenizer.ggml.pre"))
    writer.add_token_list(fields.pop("tokenizer.ggml.tokens"))
    writer.add_token_types(fields.pop("tokenizer.ggml.token_type"))
    if "tokenizer.ggml.scores" in fields:
        writer.add_token_scores(fields.pop("tokenizer.ggml.scores"))
    merges = fields.pop("tokenizer.ggml.merges")
    if merges:
        writer.add_token_merges(merges)
    if "tokenizer.chat_template" in fields:
        writer.add_chat_template(fields.pop("tokenizer.chat_template"))
    for key, value in fields.items():  # special ids and flags, under their GGUF keys
        (writer.add_bool if isinstance(value, bool) else writer.add_uint32)(key, value)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down a Q4_K_M file keeps in 6 bits (the first and
    last eighth, and every third in between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


@dataclasses.dataclass(frozen=True)
class TensorMix:
    """What llama-quantize's choice of a tensor's type depends on, beside its name and shape: the file's type, a
    tied embedding (it is the output then), the layer count, the experts (8: Mixtral's own rules) and llama.cpp's
    70B class (a llama of 80 layers with grouped KV heads)."""

    gguf_type: str
    tied: bool
    layers: int
    experts: int = 0
    llama_70b: bool = False
    imatrix: bool = False  # quantized with an importance matrix (llama-quantize --imatrix)

    @classmethod
    def of(cls, cfg: ModelConfig, gguf_type: str, tied: bool) -> "TensorMix":
        arch = GGUF_ARCHITECTURES[cfg.model_type]
        return cls(gguf_type, tied, cfg.num_layers, cfg.num_experts,
                   arch == "llama" and cfg.num_layers == 80 and cfg.num_heads != cfg.num_kv_heads)


def _mix_type(name: str, mix: TensorMix) -> str:
    """The block type llama-quantize gives a matrix of a q8_0, q6_k, q4_k_m or q4_0 file (before the shape
    fallback), without an importance matrix: the output projection (the embedding when tied) in q6_K; in q4_k_m,
    attn_v and ffn_down of `_more_bits` layers in q6_K (attn_v of a 70B llama at least q5_K), the rest q4_K; with 8
    experts (Mixtral), attn_k and attn_v in q8_0 in every type and attn_output in q5_K in q4_k_m."""
    base = "q4_k" if mix.gguf_type == "q4_k_m" else mix.gguf_type
    if name == "output.weight" or (mix.tied and name == "token_embd.weight"):
        return base if base == "q8_0" else "q6_k"
    kind = name.split(".")[-2].removesuffix("_exps") if name.startswith("blk.") else ""
    if kind in ("attn_k", "attn_v") and mix.experts == 8:
        return "q8_0"
    if mix.gguf_type == "q4_0" and mix.imatrix and kind == "ffn_down" and int(name.split(".")[1]) < mix.layers // 8:
        return "q4_1"  # llama-quantize's guard for the first ffn_down layers, taken with an importance matrix only
    if mix.gguf_type != "q4_k_m":
        return base
    if kind == "attn_v":
        more = _more_bits(int(name.split(".")[1]), mix.layers)
        return "q6_k" if more else ("q5_k" if mix.llama_70b else "q4_k")
    if kind == "ffn_down" and _more_bits(int(name.split(".")[1]), mix.layers):
        return "q6_k"
    if kind == "attn_output" and mix.experts == 8:
        return "q5_k"
    return "q4_k"


# llama-quantize's fallback for a row that is not whole 256-weight super-blocks
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def _encoding(name: str, shape: tuple[int, ...], mix: TensorMix) -> tuple[Any, Any]:
    """(raw GGML type or None, numpy dtype of the stored array) of one tensor; 1-D tensors, biases and the experts'
    router stay f32, as llama.cpp's converter writes them and llama-quantize keeps them. The quantized types pick each
    matrix's block type as llama-quantize does (`_mix_type`); a row that is not whole 256-weight super-blocks falls
    back as llama.cpp's does (`_FALLBACK`), one that is not whole 32-weight blocks to f16."""
    import gguf

    q = gguf.GGMLQuantizationType
    if len(shape) == 1 or mix.gguf_type == "f32" or not name.endswith(".weight") \
            or name.endswith("ffn_gate_inp.weight"):
        return None, np.float32
    kind = mix.gguf_type
    if kind in ("q8_0", "q6_k", "q4_k_m", "q4_0"):
        kind = _mix_type(name, mix)
        if kind in _FALLBACK and shape[-1] % 256:
            kind = _FALLBACK[kind]
    raws = {"q8_0": q.Q8_0, "q4_0": q.Q4_0, "q4_1": q.Q4_1, "q5_0": q.Q5_0, "q5_1": q.Q5_1, "q4_k": q.Q4_K, "q5_k": q.Q5_K,
            "q6_k": q.Q6_K}
    if kind in raws:
        if shape[-1] % gguf.GGML_QUANT_SIZES[raws[kind]][0] == 0:
            return raws[kind], np.uint8
        return None, np.float16
    if kind == "bf16":
        return q.BF16, np.uint8
    return None, np.float16


def _stored_info(name: str, shape: tuple[int, ...], mix: TensorMix) -> tuple[tuple[int, ...], Any, int, Any]:
    """(stored shape, dtype, bytes, raw type) of a float32 tensor of `shape` once encoded: the tensor table is
    written before any data, so each tensor can be computed and written alone."""
    import gguf

    raw, dtype = _encoding(name, shape, mix)
    stored = tuple(gguf.quants.quant_shape_to_byte_shape(shape, raw)) if raw is not None else shape
    return stored, dtype, int(np.prod(stored, dtype=np.int64)) * np.dtype(dtype).itemsize, raw


def _encode(name: str, w: np.ndarray, mix: TensorMix, importance: np.ndarray | None = None) -> np.ndarray:
    """The stored array of one float32 tensor (see `_encoding`): q4_0, q4_K, q5_K and q6_K by jaxtune's
    quantizers (byte-equal to ggml's reference ones), the other types by the `gguf` package's; with the tensor's
    `importance` (an importance matrix's weights, one per input column) the 4- to 6-bit types by ggml's weighted
    quantizers (jaxtune/quant/weighted.py)."""
    import gguf

    raw, dtype = _encoding(name, w.shape, mix)
    weighted = {gguf.GGMLQuantizationType[fmt.upper()]: fmt for fmt in WEIGHTED_FORMATS}
    if importance is not None and raw in weighted:
        return quantize_weighted(w, importance, weighted[raw])
    own = {gguf.GGMLQuantizationType.Q4_0: quantize_q4_0, gguf.GGMLQuantizationType.Q4_K: quantize_q4_k,
           gguf.GGMLQuantizationType.Q5_K: quantize_q5_k, gguf.GGMLQuantizationType.Q6_K: quantize_q6_k}
    if raw in own:
        return own[raw](w)
    return gguf.quants.quantize(w, raw) if raw is not None else w.astype(dtype)


def save_gguf(
    model: CausalLM,
    out_path: str | os.PathLike,
    *,
    tokenizer: Any,
    base: str | os.PathLike | None = None,
    gguf_type: str = "bf16",
    name: str | None = None,
    imatrix: Any = None,
) -> None:
    """Writes the merged model as a llama.cpp GGUF file (`gguf_type`: bf16, f16, q8_0, q6_k, q4_k_m, q4_0 or f32);
    a model without adapters is written as it is (a 4-bit GGUF of a base model).

    With `base` (the HF directory or .gguf of the ORIGINAL weights) the adapters are added onto those; without it,
    onto the dequantized NF4 weights (a warning says so), exactly as `save_merged`.

    `imatrix` (q4_0, q4_k_m, q6_k): an `ImportanceMatrix` or the path of llama.cpp's imatrix .gguf; each weight
    with an entry is then quantized as `llama-quantize --imatrix` does it (convert/imatrix.py).
    """
    import gguf

    cfg = _check_exportable(model, gguf_type)
    importance = _importance(model, gguf_type, imatrix)
    if tokenizer is None:
        raise CheckpointError("GGUF export needs the model's tokenizer (llama.cpp reads it from the file)")
    out_path = check_gguf_output(out_path)
    parent = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(parent, exist_ok=True)
    file_type = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                 "q6_k": gguf.LlamaFileType.MOSTLY_Q6_K, "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M,
                 "f32": gguf.LlamaFileType.ALL_F32}[gguf_type]
    interleaved_rope = GGUF_ARCHITECTURES[cfg.model_type] == "llama"  # llama.cpp's llama: q/k rows permuted
    source = open_original(model, base)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out_path)}.partial-", dir=parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, GGUF_ARCHITECTURES[cfg.model_type])
        _add_hyperparameters(writer, cfg, name or os.path.splitext(os.path.basename(out_path))[0], int(file_type))
        _add_tokenizer(writer, tokenizer, cfg)
        rope = rope_factors(cfg) if cfg.rope_type == "llama3" else None
        if rope is not None:
            writer.add_tensor_info("rope_freqs.weight", rope.shape, rope.dtype, rope.nbytes)
        tensors = _gguf_tensors(list(merged_tensors(model, source)), cfg)
        mix = dataclasses.replace(TensorMix.of(cfg, gguf_type, tied=not any(t.name == "output.weight" for t in tensors)),
                                  imatrix=importance is not None)
        weights = _importance_weights(importance, tensors)
        for t in tensors:  # the whole tensor table first; the data then follows one tensor at a time
            stored, dtype, nbytes, raw = _stored_info(t.name, t.shape, mix)
            writer.add_tensor_info(t.name, stored, np.dtype(dtype), nbytes, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        if rope is not None:
            writer.write_tensor_data(rope)
        for t in tqdm(tensors, desc="GGUF tensors", unit="tensor"):
            w = t.compute()
            if interleaved_rope and t.name.endswith("attn_q.weight"):
                w = permute_qk(w, cfg.num_heads)
            elif interleaved_rope and t.name.endswith("attn_k.weight"):
                w = permute_qk(w, cfg.num_kv_heads)
            writer.write_tensor_data(_encode(t.name, w, mix, weights.get(t.name)))
        writer.close()
        plain_permissions(tmp)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        if source is not None:
            source.close()
