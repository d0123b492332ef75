"""How the training step is compiled: the persistent cache takes effect when train() turns it on, and a
directory the user chose is kept."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxtune.training.compilation import step_compiler_options, use_compilation_cache


@pytest.fixture
def restore_cache_dir():
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def test_cache_turned_on_after_earlier_compiles_stores_the_next_one(tmp_path, monkeypatch, restore_cache_dir):
    monkeypatch.setenv("JAXTUNE_CACHE_DIR", str(tmp_path / "xla"))
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()  # a fresh process: no cache opened yet (this worker's suite opened the suite's)
    jax.jit(lambda x: x * 3 + 1)(jnp.ones(5))  # a process compiles (loads the model) before training starts
    assert use_compilation_cache(True, backend="gpu") == str(tmp_path / "xla")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # this one compiles fast
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((7, 3))).block_until_ready()
    assert [f for f in os.listdir(tmp_path / "xla") if f.startswith("jit_")], "nothing was written to the cache"


def test_a_users_cache_dir_is_kept_and_off_or_cpu_changes_nothing(tmp_path, monkeypatch, restore_cache_dir):
    monkeypatch.setenv("JAXTUNE_CACHE_DIR", str(tmp_path / "ours"))
    jax.config.update("jax_compilation_cache_dir", None)
    assert use_compilation_cache(False, backend="gpu") is None
    assert use_compilation_cache(True, backend="cpu") is None
    assert not (tmp_path / "ours").exists()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert use_compilation_cache(True, backend="gpu") == str(tmp_path / "theirs")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")


def test_an_unwritable_cache_dir_warns_and_trains_without_the_cache(tmp_path, monkeypatch, restore_cache_dir):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("JAXTUNE_CACHE_DIR", str(tmp_path / "a_file" / "xla"))
    jax.config.update("jax_compilation_cache_dir", None)
    with pytest.warns(UserWarning, match="cannot create .*a_file/xla.*JAXTUNE_CACHE_DIR"):
        assert use_compilation_cache(True, backend="gpu") is None
    assert jax.config.jax_compilation_cache_dir is None


def test_steps_on_gpu_tune_their_gemms_without_the_reference_check_and_triton_gemms_for_fp8_only():
    assert step_compiler_options("gpu") == {"xla_gpu_autotune_level": 3, "xla_gpu_enable_triton_gemm": False}
    assert step_compiler_options("gpu", "fp8") == {"xla_gpu_autotune_level": 3, "xla_gpu_enable_triton_gemm": True}
    assert step_compiler_options("cpu") is None and step_compiler_options("cpu", "fp8") is None


def test_gpu_step_options_are_options_xla_knows():
    """XLA refuses an option it does not know at compile time; the GPU options compile (unused) on any backend."""
    for compute in ("bf16", "fp8"):
        jax.jit(lambda x: x @ x, compiler_options=step_compiler_options("gpu", compute)).lower(
            jax.numpy.ones((8, 8))).compile()
