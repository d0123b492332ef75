"""q4_K / q5_K / q6_K blocks: byte-equal to llama.cpp's reference quantizers (their bytes committed by
tests/data/make_llama_cpp_k_quants.py), read back by the `gguf` package's dequantizers as by jaxtune's own."""

from __future__ import annotations

from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxtune.quant import (dequantize_q4_k, dequantize_q5_k, dequantize_q6_k, quantize_q4_k, quantize_q5_k,
                           quantize_q6_k)

FIXTURE = Path(__file__).parent / "data" / "llama_cpp_k_quants.safetensors"
FORMATS = {"q4_K": (quantize_q4_k, dequantize_q4_k, gguf.GGMLQuantizationType.Q4_K),
           "q5_K": (quantize_q5_k, dequantize_q5_k, gguf.GGMLQuantizationType.Q5_K),
           "q6_K": (quantize_q6_k, dequantize_q6_k, gguf.GGMLQuantizationType.Q6_K)}


def _llama_cpp() -> dict[str, np.ndarray]:
    return load_file(FIXTURE)


@pytest.mark.parametrize("fmt", FORMATS)
def test_k_quants_are_llama_cpps_bytes(fmt):
    """Every super-block of every fixture tensor (Gaussian, bf16-valued with rounding ties, heavy tails, row
    scales over decades, all-zero / constant / tiny / stepped blocks) is llama.cpp's, so the error is too."""
    quantize, _, raw = FORMATS[fmt]
    tensors = _llama_cpp()
    names = sorted({k.split(".")[0] for k in tensors})
    assert len(names) == 5
    for name in names:
        x, want = tensors[f"{name}.input"], tensors[f"{name}.{fmt}"]
        got = quantize(x)
        assert got.shape == want.shape and got.dtype == np.uint8
        nbytes = gguf.GGML_QUANT_SIZES[raw][1]
        differing = np.flatnonzero((got.reshape(-1, nbytes) != want.reshape(-1, nbytes)).any(-1))
        assert differing.size == 0, f"{name}: super-blocks {differing[:5]} differ from llama.cpp's"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(3, 256), (5, 768), (2, 4, 512)])
def test_k_quants_read_back_by_gguf_as_by_jaxtune(fmt, shape):
    """The bytes decode the same through the `gguf` package (llama.cpp's layout in numpy) and jaxtune's decoder;
    the 4-bit error is below q4_0's on the same Gaussian weights, the 6-bit one far below."""
    quantize, dequantize, raw = FORMATS[fmt]
    x = np.random.default_rng(sum(shape)).normal(0, 0.02, shape).astype(np.float32)
    data = quantize(x)
    assert data.shape == (*shape[:-1], shape[-1] // 256 * gguf.GGML_QUANT_SIZES[raw][1])
    theirs = gguf.quants.dequantize(data, raw).reshape(shape)
    np.testing.assert_array_equal(dequantize(data), theirs)
    q4_0 = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q4_0),
                                  gguf.GGMLQuantizationType.Q4_0).reshape(shape)
    err, base = np.sqrt(np.mean((theirs - x) ** 2)), np.sqrt(np.mean((q4_0 - x) ** 2))
    assert err < {"q4_K": 0.9, "q5_K": 0.5, "q6_K": 0.3}[fmt] * base, (err, base)


def test_k_quants_refuse_rows_of_partial_super_blocks():
    with pytest.raises(ValueError, match="whole 256-weight super-blocks; a row has 576"):
        quantize_q4_k(np.zeros((2, 576), np.float32))


def test_the_traced_q4_k_round_trip_reads_back_as_llama_cpps_bytes():
    """QAT's q4_K (traced) is what llama.cpp's own bytes of every fixture tensor read back as through the `gguf`
    package, to the bit (on a CPU: ggml's order of sums, no fused multiply-adds)."""
    from jaxtune.quant.k_quants_traced import round_trip_q4_k

    tensors = _llama_cpp()
    for name in sorted({k.split(".")[0] for k in tensors}):
        x = tensors[f"{name}.input"]
        want = gguf.quants.dequantize(tensors[f"{name}.q4_K"], gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
        np.testing.assert_array_equal(np.asarray(jax.jit(round_trip_q4_k)(x)), want, err_msg=name)


@pytest.mark.parametrize("shape", [(4, 96), (3, 576)])
def test_the_traced_q5_0_round_trip_is_the_gguf_packages(shape):
    """Rows that are not whole super-blocks: the Q4_K_M export's fallback, q5_0, as the `gguf` package (llama.cpp's
    reference in numpy) quantizes and reads it."""
    from jaxtune.quant.k_quants_traced import round_trip_q4_k_m

    x = np.random.default_rng(shape[1]).normal(0, 0.02, shape).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block
    q = gguf.GGMLQuantizationType.Q5_0
    want = gguf.quants.dequantize(gguf.quants.quantize(x, q), q).reshape(shape)
    np.testing.assert_array_equal(np.asarray(round_trip_q4_k_m(x)), want)
