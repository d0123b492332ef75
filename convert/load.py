"""`from_pretrained`: an HF directory or GGUF file -> (jaxtune model, tokenizer), tensor by tensor."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from convert import moe_names
from convert.gguf_source import GGUFSource
from convert.jaxtune_format import is_jaxtune_checkpoint, read_checkpoint
from convert.mxfp4_source import Mxfp4Source, is_mxfp4
from convert.safetensors_source import SafetensorsSource
from convert.state_tree import Path, expected_arrays, merge_filled
from jaxtune.io.bundled import model_reference, resolve_model_path
from jaxtune.models.config import ModelConfig, load_hf_config
from jaxtune.errors import CheckpointError
from jaxtune.quant import nf4
from jaxtune.models.causal_lm import CausalLM
from jaxtune.models.layer_kinds import has_experts, layer_stacks, locate
from jaxtune.qlora import quantize_layers

_IGNORED_TENSORS = re.compile(r"rotary_emb\.inv_freq$")
# a multimodal checkpoint's parts beside its language model (Qwen3.5's vision tower and multi-token-prediction head,
# Gemma 4's vision and audio towers and their embedders)
_OTHER_TOWERS = re.compile(r"(model\.visual|visual|mtp|model\.(?:vision|audio)_tower|model\.embed_(?:vision|audio))\.")
_BNB_COMPANION = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.bitsandbytes__nf4)$")



Index = int | tuple[int, int] | None  # a layer, (layer, expert) for an expert's tensor, or None (not stacked)


def hf_name_to_path(name: str) -> tuple[Path, Index] | None:
    """HF tensor name -> (path in the model's state, layer index for stacked layers or (layer, expert) for an
    expert's weight), or None if foreign."""
    if name.startswith("model.language_model."):  # a multimodal checkpoint's language model
        name = "model." + name[len("model.language_model."):]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        fused = moe_names.FUSED.fullmatch(rest)  # gpt-oss, Gemma 4: every expert of the layer in one tensor
        if fused:
            return ("fused", fused["hub"], "bias" if fused["bias"] else "weight", fused["module"]), layer
        if router := moe_names.LAYER_ROUTER.fullmatch(rest):
            return ("layers", "moe", "router", router.group(1).removeprefix("proj.")), layer
        expert = moe_names.EXPERT.fullmatch(rest)  # a mixture of experts' tensors -> the stacks under `mlp`
        if expert:
            proj = moe_names.projection_name(expert.group(2))
            return ("layers", "mlp", proj, *expert.group(3).split(".")), (layer, int(expert.group(1)))
        if router := moe_names.ROUTER.fullmatch(rest):
            return ("layers", "mlp", "router", router.group(1) or "weight"), layer
        return ("layers", *rest.split(".")), layer
    if name.startswith("model."):
        return tuple(name[len("model."):].split(".")), None
    if name == "lm_head.weight":
        return ("lm_head", "weight"), None
    return None


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(buf: jax.Array, index: jax.Array, value: jax.Array) -> jax.Array:
    """buf[index] = value for an index of the leading axes (a layer, or a layer and an expert)."""
    start = (*index, *([0] * value.ndim))
    return jax.lax.dynamic_update_slice(buf, value.reshape((1,) * index.shape[0] + value.shape),
                                        tuple(jnp.asarray(i, jnp.int32) for i in start))


def _indices(index: Index) -> tuple[int, ...]:
    return () if index is None else (index,) if isinstance(index, int) else tuple(index)


_NF4_ARRAYS = ("codes", "absmax_codes", "nested_absmax", "offset", "nested_map")


def _slots(expected: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, tuple[tuple[int, ...], bool]]:
    """Checkpoint-visible slots: path -> (shape incl. layer axis, is a weight to quantize to NF4)."""
    slots: dict[Path, tuple[tuple[int, ...], bool]] = {}
    for path, sds in expected.items():
        if path[-1] == "codes":
            *lead, out, half = sds.shape
            slots[path[:-1] + ("weight",)] = ((*lead, out, half * 2), True)
        elif path[-1] not in _NF4_ARRAYS:
            slots[path] = (tuple(sds.shape), False)
    return slots


def _plan(source, cfg: ModelConfig, slots: dict[Path, tuple[tuple[int, ...], bool]]) -> dict[str, tuple[Path, Index]]:
    """Matches every checkpoint tensor to a model slot, checking names, shapes and completeness first."""
    plan: dict[str, tuple[Path, Index]] = {}
    filled: set[tuple[Path, Index]] = set()
    names = set(source.names())
    towers = sorted(name for name in names if _OTHER_TOWERS.match(name))
    if towers:
        parts = sorted({name.split(".")[1] if name.startswith("model.") else name.split(".")[0] for name in towers})
        warnings.warn(f"skipped {len(towers)} tensors of the checkpoint's {' and '.join(parts)} (jaxtune fine-tunes "
                      "the language model; the rest stays in the original checkpoint)", stacklevel=4)
    for name in names:
        if (_IGNORED_TENSORS.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings)
                or _OTHER_TOWERS.match(name)):
            continue
        if _BNB_COMPANION.search(name):
            if name.split(".weight.")[0] + ".weight" not in names:
                raise CheckpointError(f"bnb tensor {name} has no packed weight beside it; the checkpoint is incomplete")
            continue
        target = hf_name_to_path(name)
        if target is not None and target[0][0] == "fused":
            plan[name] = _plan_fused(name, target, source, cfg, slots, names, filled)
            continue
        if target is None or (target[1] is None and target[0] not in slots):
            raise CheckpointError(
                f"checkpoint tensor {name!r} has no place in a {cfg.model_type} model with this config; "
                "the weights and config.json do not match"
            )
        path, index = target
        layer, *expert = _indices(index) or (None,)
        if layer is not None and layer >= cfg.num_layers:
            raise CheckpointError(f"checkpoint has layer {layer} but config.json says num_hidden_layers={cfg.num_layers}")
        if layer is not None:  # the decoder layer -> its place in the stack of its kind
            stack, local = locate(cfg, layer)
            path, index = (stack.attr, *path[1:]), (local, *expert) if expert else local
            target = path, index
            if path not in slots:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} does not belong in layer {layer} of this {cfg.model_type} model "
                    f"(a {stack.kind} layer); the weights and config.json do not match")
        if expert and expert[0] >= cfg.num_experts:
            raise CheckpointError(f"checkpoint has expert {expert[0]} but config.json says {cfg.num_experts} experts")
        shape = slots[path][0]
        want = shape[len(_indices(index)):]
        got = source.shape(name)
        if f"{name}.absmax" in names:
            pass  # a bnb-4bit packed weight: its quant_state shape is checked when it is read
        elif tuple(got) != tuple(want):
            raise CheckpointError(f"tensor {name} has shape {tuple(got)} but config.json implies {tuple(want)}")
        plan[name] = target
        filled.add(target)
    stacks = {stack.attr: stack for stack in layer_stacks(cfg)}
    expert_module = (moe_names.fused_layout(cfg.model_type) or moe_names.GPT_OSS).module
    for path in slots:
        stack = stacks.get(path[0])
        layers = range(len(stack.layers)) if stack else [None]
        experts = (range(cfg.num_experts) if stack and has_experts(cfg, stack) and path[1] == expert_module
                   and path[2] in ("gate_proj", "up_proj", "down_proj") else None)
        for layer in layers:
            for index in [layer] if experts is None else [(layer, e) for e in experts]:
                if (path, index) not in filled:
                    where = (f"model.layers.{stack.layers[layer]}." if layer is not None
                             else ("" if path[0] == "lm_head" else "model."))
                    inner = path[1:] if layer is not None else path
                    if experts is not None:
                        inner = ("mlp", "experts", str(index[1]), *inner[1:])
                    raise CheckpointError(f"checkpoint lacks tensor {where + '.'.join(inner)}; the download is "
                                          "incomplete or the config does not match")
    return plan


def _plan_fused(name: str, target: tuple[Path, Index], source, cfg: ModelConfig, slots, names: set[str],
                filled: set) -> tuple[Path, Index]:
    """A fused expert tensor's place: (("fused", hub name, weight or bias, the stack), its layer there), every
    expert of the projections it holds marked filled; its shape checked."""
    (_, hub, field, module), layer = target
    layout = moe_names.hub_layout(module)
    if layer >= cfg.num_layers or not cfg.num_experts:
        raise CheckpointError(f"checkpoint tensor {name!r} has no place in a {cfg.model_type} model with this config; "
                              "the weights and config.json do not match")
    if f"{name}.absmax" in names or any(n.startswith(f"{name}.") for n in names):
        raise CheckpointError(f"{name} is a quantized fused expert tensor, which jaxtune does not read; load the "
                              "bf16 checkpoint (it is quantized to NF4 at load)")
    stack, local = locate(cfg, layer)
    want = moe_names.fused_shape(hub, field == "bias", cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                 layout)
    if tuple(source.shape(name)) != want:
        raise CheckpointError(f"tensor {name} has shape {tuple(source.shape(name))} but config.json implies {want}")
    for proj in moe_names.fused_projections(hub):
        path = (stack.attr, layout.module, proj, field)
        if path not in slots:
            raise CheckpointError(f"checkpoint tensor {name!r} does not belong in layer {layer} of this "
                                  f"{cfg.model_type} model; the weights and config.json do not match")
        filled.update((path, (local, e)) for e in range(cfg.num_experts))
    return ("fused", hub, field, module, stack.attr), local


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16, load_in_4bit: bool = True) -> CausalLM:
    """The model a checkpoint of `cfg` fills, with shapes and dtypes only (nothing allocated): what a step can be
    planned and compiled from before any weight is read."""

    def build() -> CausalLM:
        model = CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        return quantize_layers(model) if load_in_4bit else model

    return nnx.eval_shape(build)


def abstract_state(cfg: ModelConfig, dtype: jnp.dtype, load_in_4bit: bool):
    """(graphdef, abstract state, pure dict, {path: ShapeDtypeStruct}) of the model a checkpoint fills."""
    graphdef, state = nnx.split(abstract_model(cfg, dtype, load_in_4bit))
    pure, expected = expected_arrays(state)
    return graphdef, state, pure, expected


class TensorPlan:
    """Where every tensor of a checkpoint goes in the model's state, and the arrays it becomes there.

    Checked up front (names, shapes, completeness); `arrays(name)` then reads one checkpoint tensor and yields the
    state arrays it fills (several for an NF4 weight), so a caller never needs more than one tensor in memory.
    """

    def __init__(self, source, cfg: ModelConfig, expected: dict[Path, jax.ShapeDtypeStruct]):
        self.source, self.expected = source, expected
        self.slots = _slots(expected)
        self.targets = _plan(source, cfg, self.slots)
        self._names = set(source.names())

    def arrays(self, name: str) -> Iterator[tuple[Path, int | None, jax.Array | np.ndarray]]:
        """(state path, layer index or None, array) for each state array that checkpoint tensor `name` fills."""
        path, layer = self.targets[name]
        if path[0] == "fused":
            yield from self._fused_arrays(name, path, layer)
            return
        quantized = self.slots[path][1]
        if quantized and f"{name}.absmax" in self._names:  # pre-quantized by bitsandbytes: no requantization
            shape = self.slots[path][0][-2:]
            bnb = {suffix: self.source.get(f"{name}.{suffix}") for suffix in nf4.BNB_TENSOR_NAMES if suffix != "weight"}
            q = nf4.from_bnb_tensors({"weight": self.source.get(name), **bnb}, shape, where=name)
        elif quantized:
            q = nf4.quantize(np.asarray(self.source.get(name), np.float32))
        elif f"{name}.absmax" in self._names:  # bnb quantized a weight jaxtune keeps 16-bit (rows of partial blocks)
            bnb = {suffix: self.source.get(f"{name}.{suffix}") for suffix in nf4.BNB_TENSOR_NAMES if suffix != "weight"}
            w = nf4.dequantize_bnb_blocks({"weight": self.source.get(name), **bnb}, self.slots[path][0][-2:], name)
            yield path, layer, w.astype(self.expected[path].dtype)
            return
        else:
            yield path, layer, np.asarray(self.source.get(name)).astype(self.expected[path].dtype, copy=False)
            return
        for field in _NF4_ARRAYS:
            key = path[:-1] + (field,)
            yield key, layer, jnp.asarray(getattr(q, field), self.expected[key].dtype)

    def _fused_arrays(self, name: str, target: Path, layer: int):
        """A fused expert tensor split into its projections, each expert's weight quantized on its own (as the
        per-expert layout's are) where the slot is NF4."""
        _, hub, field, module, attr = target
        layout = moe_names.hub_layout(module)
        # split as stored (a view of the memory-mapped or dequantized bf16 tensor), one expert in float32 at a time
        parts = moe_names.split_fused(hub, field == "bias", self.source.get(name), layout)
        for proj, stacked in parts.items():
            path = (attr, layout.module, proj, field)
            for e in range(stacked.shape[0]):
                index, array = (layer, e), np.asarray(stacked[e], np.float32)
                if not self.slots[path][1]:
                    yield path, index, array.astype(self.expected[path].dtype)
                    continue
                q = nf4.quantize(np.ascontiguousarray(array))
                for f in _NF4_ARRAYS:
                    key = path[:-1] + (f,)
                    yield key, index, jnp.asarray(getattr(q, f), self.expected[key].dtype)


def load_model(
    source, cfg: ModelConfig, dtype: str | jnp.dtype = "bfloat16", *, load_in_4bit: bool = False, desc: str = "loading"
) -> CausalLM:
    """Fills an abstract model from a tensor source; host memory holds one tensor at a time.

    With load_in_4bit the decoder projections are quantized to NF4 on the device as they arrive.
    """
    graphdef, state, pure, expected = abstract_state(cfg, jnp.dtype(dtype), load_in_4bit)
    plan = TensorPlan(source, cfg, expected)
    values: dict[Path, jax.Array] = {}
    for name in tqdm(plan.targets, desc=desc, unit="tensor", leave=False):
        for path, layer, value in plan.arrays(name):
            value = jnp.asarray(value)
            if layer is None:
                values[path] = value
                continue
            if path not in values:
                values[path] = jnp.zeros(expected[path].shape, expected[path].dtype)
            values[path] = _set_layer(values[path], jnp.asarray(_indices(layer), jnp.int32), value)
    return merge_filled(graphdef, state, pure, values)


def load_tokenizer(path: str):
    if not any(
        os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    ):
        warnings.warn(f"{path} has no tokenizer files; returning tokenizer=None", stacklevel=3)
        return None
    named = _tokenizers_backed_class(path)
    if named is not None:
        return named.from_pretrained(path)
    from transformers import AutoTokenizer  # slow import: only when a tokenizer is needed

    return AutoTokenizer.from_pretrained(path)


# the classes that are tokenizer.json and nothing else: loaded by name, they are what AutoTokenizer builds, without
# the model-config machinery AutoTokenizer imports (PyTorch too, where it is installed: ~4 s on every command)
_TOKENIZER_JSON_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizers_backed_class(path: str):
    """transformers' class for a tokenizer saved as tokenizer.json whose tokenizer_config.json names one of
    `_TOKENIZER_JSON_CLASSES` (what jaxtune writes, Llama 3's); None: AutoTokenizer decides."""
    config = os.path.join(path, "tokenizer_config.json")
    if not (os.path.isfile(config) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return None
    try:
        with open(config) as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # AutoTokenizer reports what is wrong with it
    if name not in _TOKENIZER_JSON_CLASSES:
        return None
    import transformers

    return getattr(transformers, name, None)


def open_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, Any, str | None]:
    """(config, tensor source, gguf path or None) for an HF directory or a .gguf file, validated."""
    path = resolve_model_path(os.fspath(path))
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise CheckpointError(f"{path} is a file but not a .gguf; pass an HF model directory or a .gguf file")
        source = GGUFSource(path)
        cfg = ModelConfig.from_hf(source.hf_config)
        return dataclasses.replace(cfg, generation_eos_token_ids=source.end_of_generation_ids()), source, path
    cfg = load_hf_config(path)
    source = SafetensorsSource(path)
    if mxfp4_quantization(path):  # gpt-oss's published experts: read as the dequantized layout
        source = Mxfp4Source(source)
    return cfg, source, None


def _quantization_config(model_dir: str) -> dict[str, Any] | None:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("quantization_config")


def mxfp4_quantization(model_dir: str) -> bool:
    """True for a checkpoint whose experts are stored in MXFP4 (gpt-oss's published weights), which loading
    dequantizes; such a checkpoint holds the original weights (a merge base, unlike an NF4 one)."""
    return is_mxfp4(_quantization_config(model_dir))


def bnb_quantization(model_dir: str) -> bool:
    """True for a bitsandbytes 4-bit (NF4, double-quant) HF checkpoint; a clear error for other quantizations."""
    qc = _quantization_config(model_dir)
    if not qc or is_mxfp4(qc):
        return False
    method = qc.get("quant_method")
    if method != "bitsandbytes" or not qc.get("load_in_4bit"):
        raise CheckpointError(
            f"{model_dir} is quantized with {method!r}{'' if qc.get('load_in_4bit') else ' (not 4-bit)'}; "
            "jaxtune loads bf16/fp16/fp32, bitsandbytes 4-bit NF4 or (gpt-oss) MXFP4 checkpoints"
        )
    if qc.get("bnb_4bit_quant_type", "nf4") != "nf4":
        raise CheckpointError(f"{model_dir} uses bnb_4bit_quant_type={qc.get('bnb_4bit_quant_type')!r}; only nf4 is supported")
    return True


def from_pretrained(path: str | os.PathLike, *, dtype: str = "bfloat16", load_in_4bit: bool = False,
                    revision: str | None = None):
    """Loads (model, tokenizer) from an HF directory (single or sharded safetensors) or a .gguf file.

    `path` may also be a bundled model name (`smollm2`) or a Hugging Face Hub id (`Qwen/Qwen3-8B`,
    `owner/repo/FILE.gguf`; `revision` or `owner/repo@revision` picks a branch, tag or commit), fetched through
    huggingface_hub's cache with only the files loading reads (jaxtune/io/hub.py). Weights are read tensor by tensor
    with a progress bar and cast to `dtype`; with `load_in_4bit=True` the decoder projections are quantized to NF4 (bitsandbytes
    layout) as they load, while embeddings, norms and lm_head keep `dtype`. The tokenizer comes from the same
    directory (or the GGUF's embedded one).
    """
    resolved = resolve_model_path(os.fspath(path), revision)
    reference = model_reference(os.fspath(path), revision)  # what a run records, to export it later
    if os.path.isdir(resolved) and is_jaxtune_checkpoint(resolved):
        model = read_checkpoint(resolved, dtype=dtype)
        if load_in_4bit:
            quantize_layers(model)  # no-op when already NF4
        model.name_or_path = reference
        return model, load_tokenizer(resolved)
    cfg, source, gguf_path = open_checkpoint(resolved)
    if gguf_path is None and bnb_quantization(resolved):
        load_in_4bit = True
    with source:
        name = os.path.basename(os.fspath(path).rstrip("/"))
        model = load_model(source, cfg, dtype, load_in_4bit=load_in_4bit, desc=f"loading {name}")
        tokenizer = source.tokenizer() if gguf_path is not None else load_tokenizer(resolved)
    model.name_or_path = reference
    return model, tokenizer
