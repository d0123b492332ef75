"""Checkpoints are written piece by piece: files readable by safetensors' own reader, and convert / merged / GGUF
export never holding the whole model (at 70B, 40 GB of NF4 codes or 140 GB of merged bf16) in memory."""

from __future__ import annotations

import json
import random
import tracemalloc

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file
from transformers import LlamaConfig

import jaxtune
from conftest import build_hf_model, set_random_lora
from convert import safetensors_writer
from convert.safetensors_source import SafetensorsSource
from convert.safetensors_writer import ShardedSafetensorsWriter, write_shards

# many thin layers: the whole model is many times its largest tensor, as at 70B (80 layers)
DEEP = dict(vocab_size=96, hidden_size=64, intermediate_size=256, num_hidden_layers=16, num_attention_heads=4,
            num_key_value_heads=2)


def _random_tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "stack.bf16": rng.standard_normal((5, 7, 3)).astype(ml_dtypes.bfloat16),
        "stack.u8": rng.integers(0, 256, (6, 33), dtype=np.uint8),
        "stack.scalar": rng.standard_normal(4).astype(np.float32),
        "whole.f16": rng.standard_normal((9, 5)).astype(np.float16),
        "whole.i32": rng.integers(-5, 5, (3, 11), dtype=np.int32),
        "whole.f32": rng.standard_normal(13).astype(np.float32),
    }


def _read_all(directory) -> dict[str, np.ndarray]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(directory / fname), framework="numpy") as f:  # validates the header and offsets
            assert f.metadata() == {"format": "test"}
        out.update(load_file(str(directory / fname)))
    assert {k: index["weight_map"][k] for k in out} == index["weight_map"]
    return out


@pytest.mark.parametrize("shard_bytes", [64, 400, 1 << 20])
def test_planned_writer_in_any_order_reads_back_in_safetensors(tmp_path, shard_bytes):
    tensors = _random_tensors(np.random.default_rng(shard_bytes))
    specs = [(k, v.shape, v.dtype) for k, v in tensors.items()]
    writer = ShardedSafetensorsWriter(str(tmp_path), specs, metadata={"format": "test"}, shard_bytes=shard_bytes)
    pieces = [(k, v[i], i) for k, v in tensors.items() if k.startswith("stack") for i in range(len(v))]
    pieces += [(k, v, None) for k, v in tensors.items() if k.startswith("whole")]
    random.Random(shard_bytes).shuffle(pieces)
    for name, value, index in pieces:
        writer.write(name, value, index=index)
    writer.finish()
    got = _read_all(tmp_path)
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k].view(np.uint8), v.view(np.uint8), err_msg=k)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 if shard_bytes > 1000 else len(files) > 2


def test_planned_writer_refuses_a_missing_layer_or_a_wrong_shape(tmp_path):
    tensors = _random_tensors(np.random.default_rng(0))
    writer = ShardedSafetensorsWriter(str(tmp_path), [(k, v.shape, v.dtype) for k, v in tensors.items()],
                                      metadata={"format": "test"})
    with pytest.raises(ValueError, match=r"stack.u8\[0\]: shape \(32,\), expected \(33,\)"):
        writer.write("stack.u8", tensors["stack.u8"][0, :32], index=0)
    with pytest.raises(IndexError, match="outside the leading axis"):
        writer.write("stack.u8", tensors["stack.u8"][0], index=6)
    for k, v in tensors.items():
        for i in range(len(v) - 1 if k == "stack.bf16" else len(v)) if k.startswith("stack") else [None]:
            writer.write(k, v if i is None else v[i], index=i)
    with pytest.raises(RuntimeError, match="stack.bf16"):
        writer.finish()


def test_planning_a_file_costs_no_memory_per_row(tmp_path):
    """A packed NF4 tensor has millions of rows ([n, 1] uint8): planning and writing its file must not keep
    anything per row (a set of row numbers per tensor took 24 GiB for a 3B checkpoint)."""
    codes = np.random.default_rng(0).integers(0, 256, (4_000_000, 1), dtype=np.uint8)
    tracemalloc.start()
    try:
        with ShardedSafetensorsWriter(str(tmp_path), [("codes", codes.shape, codes.dtype)],
                                      metadata={"format": "test"}) as writer:
            writer.write("codes", codes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    np.testing.assert_array_equal(_read_all(tmp_path)["codes"], codes)


def test_write_shards_streams_a_generator_into_bounded_files(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.standard_normal((i + 1, 8)).astype(np.float32) for i in range(12)}
    write_shards(str(tmp_path), iter(tensors.items()), metadata={"format": "test"}, shard_bytes=200)
    got = _read_all(tmp_path)
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)
    files = sorted(tmp_path.iterdir())
    assert all(p.name.endswith(".safetensors") or p.name.endswith(".json") for p in files)
    n = len(files) - 1
    assert n > 4 and all(p.name.endswith(f"-of-{n:05d}.safetensors") for p in files if p.suffix == ".safetensors")
    sizes = [sum(v.nbytes for k, v in load_file(str(p)).items()) for p in files if p.suffix == ".safetensors"]
    assert max(sizes) <= max(200, max(v.nbytes for v in tensors.values()))


def _live_device_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def test_convert_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The cause this guards against: building the whole quantized model before writing (40 GB at 70B)."""
    build_hf_model(LlamaConfig(**DEEP), tmp_path / "hf")
    direct, _ = jaxtune.from_pretrained(tmp_path / "hf", load_in_4bit=True)
    whole = sum(a.nbytes for a in jax.tree.leaves(nnx.state(direct)))
    largest = 4 * DEEP["intermediate_size"] * DEEP["hidden_size"]  # float32 bytes of the widest projection
    del direct
    seen: list[int] = []
    real_get = SafetensorsSource.get

    def get(self, name):  # measured as each checkpoint tensor is read: what the conversion holds by then
        seen.append(_live_device_bytes() - base)
        return real_get(self, name)

    monkeypatch.setattr(SafetensorsSource, "get", get)
    base = _live_device_bytes()
    jaxtune.convert(tmp_path / "hf", tmp_path / "out")
    assert seen and whole > 8 * largest
    assert max(seen) < 3 * largest, (max(seen), largest, whole)
    loaded, _ = jaxtune.from_pretrained(tmp_path / "out")
    direct, _ = jaxtune.from_pretrained(tmp_path / "hf", load_in_4bit=True)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(loaded), jax.tree_util.tree_leaves_with_path(direct)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def _lora_model(tmp_path):
    build_hf_model(LlamaConfig(**DEEP), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(model, r=4, lora_alpha=8)
    set_random_lora(model, seed=3)
    return model


def _peak_host_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_merged_export_holds_one_tensor_at_a_time(tmp_path):
    """The cause: every merged tensor gathered before the first file was written (140 GB of bf16 at 70B)."""
    model = _lora_model(tmp_path)
    peak = _peak_host_bytes(lambda: jaxtune.save_merged(model, tmp_path / "merged", base=tmp_path / "base"))
    merged = load_file(str(next((tmp_path / "merged").glob("*.safetensors"))))
    whole = sum(v.nbytes for v in merged.values())
    largest = 4 * DEEP["intermediate_size"] * DEEP["hidden_size"]
    assert whole > 8 * largest
    assert peak < 6 * largest + (1 << 20), (peak, largest, whole)  # a few float32 copies of one tensor + overhead


def test_gguf_export_holds_one_tensor_at_a_time(tmp_path, tiny_tokenizer):
    """The cause: the writer keeping every encoded tensor until the end (or spooling them to a second file)."""
    build_hf_model(LlamaConfig(**{**DEEP, "vocab_size": len(tiny_tokenizer)}), tmp_path / "base")
    model, _ = jaxtune.from_pretrained(tmp_path / "base", dtype="float32", load_in_4bit=True)
    jaxtune.get_peft_model(model, r=4, lora_alpha=8)
    set_random_lora(model, seed=3)
    out = tmp_path / "out" / "m.gguf"
    peak = _peak_host_bytes(lambda: jaxtune.save_gguf(model, out, tokenizer=tiny_tokenizer, base=tmp_path / "base",
                                                       gguf_type="f32"))
    largest = 4 * max(DEEP["intermediate_size"] * DEEP["hidden_size"], len(tiny_tokenizer) * DEEP["hidden_size"])
    assert out.stat().st_size > 8 * largest
    assert peak < 6 * largest + (4 << 20), (peak, largest, out.stat().st_size)  # + the tokenizer's metadata
    assert [p.name for p in out.parent.iterdir()] == ["m.gguf"]


def test_default_shard_size_is_read_when_writing(monkeypatch, tmp_path):
    monkeypatch.setattr(safetensors_writer, "SHARD_BYTES", 64)
    write_shards(str(tmp_path), [(f"t{i}", np.zeros(16, np.float32)) for i in range(3)], metadata={"format": "test"})
    assert len(list(tmp_path.glob("*.safetensors"))) == 3
