"""How the training step is compiled on GPU: XLA options per compute mode, and a persistent compilation cache."""

from __future__ import annotations

import os
import warnings

import jax

# XLA tunes each GEMM of a step over its candidates (Triton, cuBLAS / cuBLASLt). At the default level (4) it also
# checks every candidate's output against a reference GEMM; that check reports a disagreeing candidate and drops it
# only at level 5 (XLA's flag documentation), so it changes no choice, but it costs compile time and device memory
# while the weights are resident. Level 3 (candidates timed on initialized buffers, re-initialized between runs):
# the 8B FP8 step compiles in 11-14 s instead of 28 / 52 / 100 s at batch 1 / 4 / 8, at the same speed with the
# same losses (benchmarks/results/2026-11-24-fp8-compile-h200.md); the 8B bf16 per-layer step's compile-time peak
# falls from 7.84 to 7.30 GiB at the same speed (benchmarks/results/2026-11-26-offsets-autotuner-fsdp-32b-h200.md)
AUTOTUNE_LEVEL = 3
# XLA fuses LoRA's rank-r GEMMs with the elementwise work around them into Triton GEMMs. In bf16 steps switching
# that off (every dot to cuBLAS, whose epilogues then take the adds) is faster at every size, with less memory and a
# 2-3x shorter compile: Llama-3.2-1B / 3B batch 16 +1.0% / +1.7%, Llama-3-8B batch 4 +0.8%, Qwen3-32B batch 2
# +1.8% (benchmarks/results/2026-11-26-32b-pairs-h100.md, one hold of an H100). FP8 steps keep them: their scaled
# GEMM epilogues are Triton fusions, 5% slower without (benchmarks/results/2026-11-24-fp8-compile-h200.md)
TRITON_GEMM = {"bf16": False, "fp8": True}


def step_compiler_options(backend: str | None = None, compute: str = "bf16") -> dict[str, int | bool] | None:
    """XLA compiler options for a training, evaluation or reference step: on GPU the GEMM autotuner without its
    reference check (bf16 and FP8 alike), and XLA's Triton GEMM fusions for FP8 compute only."""
    backend = backend or jax.default_backend()
    if backend == "gpu":
        return {"xla_gpu_autotune_level": AUTOTUNE_LEVEL, "xla_gpu_enable_triton_gemm": TRITON_GEMM[compute]}
    return None


def default_cache_dir() -> str:
    """$JAXTUNE_CACHE_DIR, else $XDG_CACHE_HOME/jaxtune/xla (~/.cache/jaxtune/xla)."""
    if os.environ.get("JAXTUNE_CACHE_DIR"):
        return os.environ["JAXTUNE_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxtune", "xla")


def use_compilation_cache(enabled: bool, backend: str | None = None) -> str | None:
    """Point JAX's persistent compilation cache at `default_cache_dir()` (GPU only), so a rerun or a resumed run
    loads its compiled step instead of compiling it again (8B step: ~2 s instead of 10-50 s). A cache directory
    the user set (`jax_compilation_cache_dir`, JAX_COMPILATION_CACHE_DIR) is kept. Returns the directory in use."""
    current = jax.config.jax_compilation_cache_dir
    if current or not enabled or (backend or jax.default_backend()) != "gpu":
        return current
    path = default_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home: train without the cache rather than not at all
        warnings.warn(f"compiled steps are not cached: cannot create {path} ({e.strerror}); set JAXTUNE_CACHE_DIR "
                      "to a writable directory, or pass compile_cache=False / --no-compile-cache", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path
