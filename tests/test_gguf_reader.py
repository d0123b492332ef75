"""jaxtune's GGUF reader (gguf's reader reading its fields through a plain ndarray view of the memory map) reads
every field and tensor exactly as gguf's own reader does: on the bundled SmolLM2 and on a GGUF jaxtune writes."""

from __future__ import annotations

import gguf.gguf_reader
import numpy as np
import pytest

from convert.gguf_source import _plain_array_reader


def assert_reads_as_gguf(path) -> None:
    ours, theirs = _plain_array_reader()(path), gguf.gguf_reader.GGUFReader(path)
    assert type(ours) is not gguf.gguf_reader.GGUFReader  # the fast path is the one under test
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields) > 10
    for name, field in theirs.fields.items():
        got = ours.fields[name]
        assert (got.name, got.offset, got.types, got.data) == (field.name, field.offset, field.types, field.data), name
        assert len(got.parts) == len(field.parts), name
        for a, b in zip(got.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert got.contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors] and theirs.tensors
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
               (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert a.data.dtype == b.data.dtype and a.data.tobytes() == b.data.tobytes(), a.name


def test_the_bundled_smollm2_reads_as_ggufs_reader_reads_it(smollm2_path):
    assert_reads_as_gguf(smollm2_path)


def test_a_gguf_jaxtune_writes_reads_as_ggufs_reader_reads_it(tmp_path, tiny_qlora_model, tiny_tokenizer):
    from convert.gguf_export import save_gguf
    from jaxtune import get_peft_model

    get_peft_model(tiny_qlora_model, r=4)
    with pytest.warns(UserWarning, match="dequantized NF4"):
        save_gguf(tiny_qlora_model, tmp_path / "m.gguf", tokenizer=tiny_tokenizer, gguf_type="q8_0")
    assert_reads_as_gguf(tmp_path / "m.gguf")
