"""`convert`: any supported checkpoint -> a jaxtune checkpoint (pre-quantized NF4 by default)."""

from __future__ import annotations

import os
import time

from convert.jaxtune_format import check_quantization, write_checkpoint
from convert.load import from_pretrained
from jaxtune.bundled import resolve_model_path
from jaxtune.errors import CheckpointError
from jaxtune.qlora import LoRALinear, NF4Linear


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, quantize: str = "nf4", dtype: str = "bfloat16") -> float:
    """Converts SRC (HF directory, bnb-4bit HF directory, .gguf, bundled name) into a jaxtune checkpoint DST.

    With quantize="nf4" the decoder projections are stored as NF4 so loading does no quantization work.
    Written to a temp dir and renamed: a failed convert leaves no DST. Returns the seconds it took.
    """
    check_quantization(quantize)
    if os.path.exists(dst):
        raise CheckpointError(f"{os.fspath(dst)} already exists; choose a new output directory or delete it first")
    start = time.perf_counter()
    model, tokenizer = from_pretrained(src, dtype=dtype, load_in_4bit=quantize == "nf4")
    proj = model.layers.mlp.up_proj
    if isinstance(proj, LoRALinear):
        raise CheckpointError("the model carries LoRA adapters; convert a base checkpoint and save adapters separately")
    write_checkpoint(model, tokenizer, dst, quantization="nf4" if isinstance(proj, NF4Linear) else "none",
                     source=os.path.abspath(resolve_model_path(os.fspath(src))))
    return time.perf_counter() - start
