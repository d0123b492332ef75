"""`convert`: any supported checkpoint -> a jaxtune checkpoint (pre-quantized NF4 by default).

An HF directory (bf16 or bitsandbytes 4-bit) or a .gguf is converted tensor by tensor: each source tensor is read,
quantized, and written at its place in the output files, so neither host nor device memory ever holds the model
(a 70B converts on a machine with a fraction of its size in RAM).
"""

from __future__ import annotations

import os
import time

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from convert.atomic import atomic_directory, check_writable
from convert.jaxtune_format import (SHARD_METADATA, check_quantization, is_jaxtune_checkpoint, write_checkpoint,
                                    write_description)
from convert.load import (TensorPlan, abstract_state, bnb_quantization, from_pretrained, load_tokenizer,
                          open_checkpoint)
from convert.safetensors_writer import ShardedSafetensorsWriter
from jaxtune.io.bundled import resolve_model_path
from jaxtune.errors import CheckpointError
from jaxtune.moe.experts import NF4Experts
from jaxtune.qlora import NF4Linear


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, quantize: str = "nf4", dtype: str = "bfloat16") -> float:
    """Converts SRC (HF directory, bnb-4bit HF directory, .gguf, bundled name) into a jaxtune checkpoint DST.

    With quantize="nf4" the decoder projections are stored as NF4 so loading does no quantization work.
    Written to a temp dir and renamed: a failed convert leaves no DST. Returns the seconds it took.
    """
    check_quantization(quantize)
    if os.path.exists(dst):
        raise CheckpointError(f"{os.fspath(dst)} already exists; choose a new output directory or delete it first")
    check_writable(dst, "output directory")  # a read-only place: refused before the model loads
    start = time.perf_counter()
    resolved = resolve_model_path(os.fspath(src))
    if os.path.isdir(resolved) and is_jaxtune_checkpoint(resolved):  # re-quantizing a jaxtune checkpoint
        model, tokenizer = from_pretrained(resolved, dtype=dtype, load_in_4bit=quantize == "nf4")
        write_checkpoint(model, tokenizer, dst, source=os.path.abspath(resolved),
                         quantization="nf4" if isinstance(model.layers.mlp.up_proj, (NF4Linear, NF4Experts)) else "none")
    else:
        _convert_streaming(resolved, os.fspath(dst), quantize=quantize, dtype=jnp.dtype(dtype),
                           name=os.path.basename(os.fspath(src).rstrip("/")))
    return time.perf_counter() - start


def _convert_streaming(src: str, dst: str, *, quantize: str, dtype: jnp.dtype, name: str) -> None:
    cfg, source, gguf_path = open_checkpoint(src)
    with source:
        load_in_4bit = quantize == "nf4" or (gguf_path is None and bnb_quantization(src))  # bnb stays NF4
        _, _, _, expected = abstract_state(cfg, dtype, load_in_4bit)
        plan = TensorPlan(source, cfg, expected)
        tokenizer = source.tokenizer() if gguf_path is not None else load_tokenizer(src)
        with atomic_directory(dst) as tmp:
            specs = [(".".join(path), sds.shape, np.dtype(sds.dtype)) for path, sds in expected.items()]
            with ShardedSafetensorsWriter(tmp, specs, metadata=SHARD_METADATA) as writer:
                for tensor in tqdm(plan.targets, desc=f"converting {name}", unit="tensor", leave=False):
                    for path, layer, value in plan.arrays(tensor):
                        writer.write(".".join(path), np.asarray(value), index=layer)
            write_description(tmp, cfg, tokenizer, quantization="nf4" if load_in_4bit else "none", dtype=dtype,
                              source=os.path.abspath(src))
