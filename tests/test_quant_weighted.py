"""Importance-weighted quantizers (llama-quantize --imatrix) against llama.cpp's own bytes, and what the weights
buy: a lower importance-weighted error than the plain quantizers'."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxtune.quant import quantize_q4_0, quantize_q4_k, quantize_q6_k
from jaxtune.quant.weighted import WEIGHTED_FORMATS, quantize_weighted

FIXTURE = Path(__file__).parent / "data" / "llama_cpp_imatrix_quants.safetensors"
RAW = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
       "q5_0": gguf.GGMLQuantizationType.Q5_0, "q5_1": gguf.GGMLQuantizationType.Q5_1,
       "q4_K": gguf.GGMLQuantizationType.Q4_K, "q5_K": gguf.GGMLQuantizationType.Q5_K,
       "q6_K": gguf.GGMLQuantizationType.Q6_K}


@pytest.mark.parametrize("fmt", WEIGHTED_FORMATS)
def test_weighted_quantizers_are_llama_cpps_bytes(fmt):
    """Every block of every fixture tensor (Gaussian, bf16-valued, heavy tails, row scales over decades, edge
    blocks) with its importance vector (decades apart, a run of zero weights) is what ggml's quantize_<fmt> writes
    with those quant_weights (tests/data/make_llama_cpp_imatrix_quants.py)."""
    tensors = load_file(FIXTURE)
    names = sorted({k.split(".")[0] for k in tensors})
    assert len(names) == 5
    nbytes = gguf.GGML_QUANT_SIZES[RAW[fmt]][1]
    for name in names:
        x, w, want = tensors[f"{name}.input"], tensors[f"{name}.importance"], tensors[f"{name}.{fmt}"]
        got = quantize_weighted(x, w, fmt)
        assert got.shape == want.shape and got.dtype == np.uint8
        differing = np.flatnonzero((got.reshape(-1, nbytes) != want.reshape(-1, nbytes)).any(-1))
        assert differing.size == 0, f"{name}: blocks {differing[:5]} differ from llama.cpp's"


@pytest.mark.parametrize("fmt, plain", [("q4_0", quantize_q4_0), ("q4_K", quantize_q4_k), ("q6_K", quantize_q6_k)])
def test_the_importance_weighted_error_is_lower_than_the_plain_quantizers(fmt, plain):
    """Columns whose inputs are large (an importance 100x the others') come out closer to the weights than the plain
    quantizer leaves them: the error weighted by the importance falls."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.02, (64, 512)).astype(np.float32)
    importance = np.where(rng.random(512) < 0.1, 100.0, 1.0).astype(np.float32)

    def weighted_error(data):
        back = gguf.quants.dequantize(np.asarray(data), RAW[fmt]).reshape(w.shape)
        return float((importance * (back - w) ** 2).sum())

    assert weighted_error(quantize_weighted(w, importance, fmt)) < 0.8 * weighted_error(plain(w))


def test_a_mismatched_importance_vector_is_refused_in_one_line():
    with pytest.raises(ValueError, match="one weight per column") as e:
        quantize_weighted(np.zeros((2, 64), np.float32), np.ones(32, np.float32), "q4_0")
    assert "\n" not in str(e.value)
