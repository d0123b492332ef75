"""benchmarks/steps/step_memory.py names what a compiled step holds at its peak: its reading of XLA's live-range dump
gives back a buffer of known size, and the script's plan adds up for a 1B model compiled from shapes only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import benchmark_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "steps" / "step_memory.py"


def _script():
    return benchmark_script("step_memory")


def _dump_as_step(tmp_path, code: str) -> str:
    """Runs `code` (which compiles a jitted lambda) with XLA's dump on, its files named as the step's module (the
    readers look for the step by name); returns the dump folder."""
    # no compilation cache: a program another run cached would load without being compiled, so nothing is dumped
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_module_re=.*lambda.*",
               JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    subprocess.run([sys.executable, "-c", "import jax, jax.numpy as jnp\n" + code], check=True, env=env, cwd=ROOT)
    for path in tmp_path.glob("*lambda*"):
        path.rename(path.with_name(path.name.replace("lambda", "step")))
    return str(tmp_path)


def test_the_peak_reading_finds_a_temporary_of_known_size(tmp_path):
    # a jitted function whose only large temporary is a float32 [2048, 4096] product (32 MiB), live while its
    # row sums are taken
    dump = _dump_as_step(tmp_path, (
        "f = jax.jit(lambda a, b: jnp.sum(jnp.tanh(a @ b), axis=1) + jnp.sum(jnp.tanh(a @ b) ** 2, axis=0)[:2048])\n"
        "f.lower(jax.ShapeDtypeStruct((2048, 256), jnp.float32), jax.ShapeDtypeStruct((256, 4096), jnp.float32))"
        ".compile()\n"))
    buffers = _script().peak_buffers(dump, top=5)
    assert buffers, "no buffers read from the live-range dump"
    assert buffers[0]["gib"] == round(2048 * 4096 * 4 / 2**30, 3)  # 32 MiB, the product
    assert all(b["gib"] <= buffers[0]["gib"] for b in buffers)


def test_the_concatenation_reading_finds_a_join_of_known_size(tmp_path):
    # a [512, 1024] join of two halves (2 MiB in float32, 1 MiB if XLA casts to bf16 first) and a float32 [256, 64]
    # one (64 KiB)
    dump = _dump_as_step(tmp_path, (
        "f = jax.jit(lambda a, b: (jnp.concatenate([jnp.tanh(a), jnp.sin(a)], axis=1).astype(jnp.bfloat16), "
        "jnp.concatenate([b, b * 2])))\n"
        "f.lower(jax.ShapeDtypeStruct((512, 512), jnp.float32), jax.ShapeDtypeStruct((128, 64), jnp.float32))"
        ".compile()\n"))
    joins = _script().largest_concatenations(dump, top=5)
    assert [j["mib"] for j in joins][:2] in ([2.0, 0.06], [1.0, 0.06])
    assert joins[0]["shape"].endswith("[512,1024]") and "concatenate" in joins[0]["op"]
    assert joins[1]["shape"] == "f32[256,64]" and joins[1]["computation"].startswith("fused_computation")


def test_the_plan_of_a_1b_step_compiled_from_shapes(tmp_path):
    # no compilation cache: a step an earlier run cached loads without being compiled, so XLA dumps nothing
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path),
               JAX_ENABLE_COMPILATION_CACHE="false")
    out = subprocess.run([sys.executable, str(SCRIPT), "--model", "llama3.2-1b", "--seq", "1024", "--remat", "per-layer",
                          "none", "--top", "5"], check=True, env=env, cwd=ROOT, capture_output=True, text=True).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [line["remat"] for line in lines] == ["per-layer", "none"]
    for line in lines:
        assert line["planned_device_gib"] >= line["planned_argument_gib"] > 0
        assert 0 < len(line["peak_buffers"]) <= 5
    # keeping every layer's activations (none) plans more temporaries than recomputing them (per-layer)
    assert lines[1]["planned_temp_gib"] > lines[0]["planned_temp_gib"]
