"""jaxtune's own checkpoint: the model state as stacked safetensors, loaded with no conversion work.

Layout of a directory:
    jaxtune.json              {"format_version": 1, "quantization": "nf4" | "none", "dtype": "bfloat16"}
    config.json               the HF config of the architecture
    model-0000i-of-0000n.safetensors + model.safetensors.index.json
                              one tensor per state array, named by its path ("layers.mlp.up_proj.codes"),
                              decoder layers stacked on a leading axis
    tokenizer files           as written by the tokenizer's save_pretrained
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

from convert.atomic import atomic_directory
from convert.safetensors_source import SafetensorsSource
from convert.safetensors_writer import write_shards
from convert.state_tree import expected_arrays, merge_filled
from jaxtune.models.config import ModelConfig, generation_config_json, load_hf_config
from jaxtune.errors import CheckpointError
from jaxtune.io.jsonfile import read_json_file
from jaxtune.models.causal_lm import CausalLM
from jaxtune.qlora import quantize_layers

FORMAT_FILE = "jaxtune.json"
FORMAT_VERSION = 1
QUANTIZATIONS = ("nf4", "none")
SHARD_METADATA = {"format": "jaxtune"}


def is_jaxtune_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, FORMAT_FILE))


def read_meta(path: str) -> dict:
    """The checkpoint's jaxtune.json (format version, quantization, dtype, source)."""
    return read_json_file(os.path.join(path, FORMAT_FILE), missing=f"{path} is not a jaxtune checkpoint (no {FORMAT_FILE})")


def converted_from(path: str) -> str | None:
    """The checkpoint a jaxtune checkpoint was converted from, as recorded by `convert`, if it still exists."""
    source = read_meta(path).get("source")
    return source if isinstance(source, str) and os.path.exists(source) else None


def check_quantization(name: str) -> str:
    if name not in QUANTIZATIONS:
        raise CheckpointError(f"unknown quantization {name!r}; supported: {', '.join(QUANTIZATIONS)}")
    return name


def abstract_for(cfg: ModelConfig, dtype: jnp.dtype, quantization: str) -> CausalLM:
    """The abstract (shape-only) model of a config, dtype and quantization."""

    def build() -> CausalLM:
        model = CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0))
        return quantize_layers(model) if quantization == "nf4" else model

    return nnx.eval_shape(build)


def _flat_arrays(model: CausalLM) -> dict[str, jax.Array]:
    _, arrays = expected_arrays(nnx.state(model))
    return {".".join(path): value for path, value in arrays.items()}


def write_checkpoint(model: CausalLM, tokenizer: Any, out_dir: str | os.PathLike, *, quantization: str,
                     source: str | None = None) -> None:
    """Writes model (+ tokenizer) to out_dir atomically: a temp dir beside it, renamed when complete.

    `source` (the checkpoint it was converted from) is recorded so exports can merge onto the original weights.
    """
    with atomic_directory(out_dir) as tmp:
        write_shards(tmp, _flat_arrays(model).items(), metadata=SHARD_METADATA)
        write_description(tmp, model.config, tokenizer, quantization=quantization, dtype=model.dtype, source=source)


def write_description(directory: str, cfg: ModelConfig, tokenizer: Any, *, quantization: str, dtype: Any,
                      source: str | None = None) -> None:
    """config.json, the tokenizer files and jaxtune.json beside a checkpoint's weights; jaxtune.json, written last,
    marks the directory complete."""
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f, indent=2)
    write_generation_config(directory, cfg)
    meta = {"format_version": FORMAT_VERSION, "quantization": quantization, "dtype": str(jnp.dtype(dtype))}
    if source is not None:
        meta["source"] = source
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, FORMAT_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def read_checkpoint(path: str, *, dtype: str | None = None) -> CausalLM:
    """Loads a jaxtune checkpoint: each stored array goes straight to the device (no quantization work)."""
    meta = read_meta(path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has jaxtune format version {meta.get('format_version')}; this jaxtune reads version "
            f"{FORMAT_VERSION}: re-run jaxtune convert"
        )
    quantization = check_quantization(meta.get("quantization", "none"))
    cfg = load_hf_config(path)
    stored_dtype = jnp.dtype(meta.get("dtype", "bfloat16"))
    target_dtype = jnp.dtype(dtype) if dtype is not None else stored_dtype
    graphdef, state = nnx.split(abstract_for(cfg, target_dtype, quantization))
    pure, expected = expected_arrays(state)
    with SafetensorsSource(path) as source:
        names = set(source.names())
        for path_tuple, want in expected.items():
            name = ".".join(path_tuple)
            if name not in names:
                raise CheckpointError(f"{path} lacks tensor {name}; the checkpoint is incomplete, re-run jaxtune convert")
            if tuple(source.shape(name)) != tuple(want.shape):
                raise CheckpointError(f"tensor {name} has shape {tuple(source.shape(name))}, expected {tuple(want.shape)}")

        def put(item):
            path_tuple, want = item
            host = source.get(".".join(path_tuple))
            return path_tuple, jax.device_put(host if host.dtype == want.dtype else host.astype(want.dtype))

        # threads overlap page-cache reads with host-to-device copies (both release the GIL)
        with ThreadPoolExecutor(max_workers=8) as pool:
            desc = f"loading {os.path.basename(path.rstrip('/'))}"
            values = dict(tqdm(pool.map(put, expected.items()), total=len(expected), desc=desc, unit="tensor", leave=False))
        jax.block_until_ready(list(values.values()))
    return merge_filled(graphdef, state, pure, values)


def write_generation_config(directory: str, cfg: ModelConfig) -> None:
    """generation_config.json beside config.json where the model has generation eos ids, as transformers saves it."""
    generation = generation_config_json(cfg)
    if generation is not None:
        with open(os.path.join(directory, "generation_config.json"), "w") as f:
            json.dump(generation, f, indent=2)
