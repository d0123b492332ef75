"""GGUF exports of mixtures of experts (and llama.cpp's 70B class) hold the tensor types, and for the small models the
very bytes, that llama.cpp's own llama-quantize writes from the same f32 file: the router always F32, Mixtral's
8-expert rules (attn_k / attn_v in Q8_0, attn_output in Q5_K at Q4_K_M) and their fallbacks (recorded by
tests/data/make_llama_quantize_mixes.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import pytest

import jaxtune
from gguf_mixes import BYTES_CASES, CASES, FTYPES, mix_model

RECORDED = json.loads((Path(__file__).parent / "data" / "llama_quantize_mixes.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_every_tensor_type_is_llama_quantizes(case, tiny_tokenizer):
    from convert.gguf_export import TensorMix, _encoding, _gguf_tensors
    from convert.merged import merged_tensors

    model = mix_model(case, len(tiny_tokenizer))
    tensors = _gguf_tensors(list(merged_tensors(model, None)), model.config)
    tied = not any(t.name == "output.weight" for t in tensors)
    for ftype in FTYPES:
        mix = TensorMix.of(model.config, ftype, tied)
        ours = {}
        for t in tensors:
            raw, dtype = _encoding(t.name, t.shape, mix)
            ours[t.name] = raw.name if raw is not None else {"float32": "F32", "float16": "F16"}[dtype.__name__]
        want = RECORDED[case]["types"][ftype]
        assert ours == want, {k: (v, want.get(k)) for k, v in ours.items() if want.get(k) != v}


@pytest.mark.parametrize("case", BYTES_CASES)
def test_moe_gguf_bytes_are_llama_quantizes(case, tiny_tokenizer, tmp_path):
    """save_gguf of a model without adapters, each type: every tensor's bytes equal llama-quantize's from jaxtune's
    f32 file of the same model."""
    model = mix_model(case, len(tiny_tokenizer))
    for ftype in FTYPES:
        path = tmp_path / f"{ftype}.gguf"
        jaxtune.save_gguf(model, path, tokenizer=tiny_tokenizer, gguf_type=ftype)
        ours = {t.name: hashlib.sha256(t.data.tobytes()).hexdigest() for t in gguf.GGUFReader(path).tensors}
        want = RECORDED[case]["sha256"][ftype]
        assert set(ours) == set(want)
        assert [n for n in ours if ours[n] != want[n]] == [], ftype
        path.unlink()
