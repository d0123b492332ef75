"""jaxtune's q4_0 quantizer against the `gguf` package's (a numpy port of ggml's reference), byte for byte."""

from __future__ import annotations

import numpy as np
import pytest


def _gguf(w: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (7, 4096), (2, 5, 96)])
def test_q4_0_bytes_equal_ggmls_on_random_rows(shape):
    """Rows of several lengths and magnitudes (1e-3 to 30 per row); read back as gguf reads them."""
    import gguf

    from jaxtune.quant import dequantize_q4_0, quantize_q4_0

    rng = np.random.default_rng(len(shape) * shape[-1])
    w = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0], size=(*shape[:-1], 1))).astype(np.float32)
    ours = quantize_q4_0(w)
    np.testing.assert_array_equal(ours, _gguf(w))
    np.testing.assert_array_equal(np.asarray(dequantize_q4_0(ours)),
                                  gguf.quants.dequantize(ours, gguf.GGMLQuantizationType.Q4_0))


def test_q4_0_bytes_equal_ggmls_on_edge_blocks():
    """A zero block, ties of the largest magnitude (the first wins, its sign sets the scale's), weights exactly on
    a code's rounding edge, a constant block, a scale that overflows float16. A block whose largest weight is
    subnormal has no defined reference bytes (ggml casts NaN, 0 x inf, to an integer): both read back as zeros."""
    import gguf

    from jaxtune.quant import dequantize_q4_0, quantize_q4_0

    blocks = np.zeros((8, 32), np.float32)
    blocks[1, [3, 9]] = [2.0, -2.0]  # tie: +2 first
    blocks[2, [3, 9]] = [-2.0, 2.0]  # tie: -2 first
    blocks[3] = -8.0 + 0.5 * np.arange(32) % 16  # d = 1: w + 8.5 lands on integers and halves
    blocks[3, 0] = -8.0
    blocks[4] = 0.75  # constant
    blocks[5, :4] = [1e6, -3e5, 7.0, -1.0]  # d = -125,000 overflows float16 to -inf
    blocks[6, 7] = 1e-42  # subnormal
    blocks[7] = np.linspace(-1, 1, 32, dtype=np.float32)
    ours = quantize_q4_0(blocks)
    with np.errstate(all="ignore"):
        want = _gguf(blocks)
    defined = [0, 1, 2, 3, 4, 5, 7]
    np.testing.assert_array_equal(ours[defined], want[defined])
    np.testing.assert_array_equal(np.asarray(dequantize_q4_0(ours[6])), np.zeros(32, np.float32))
    np.testing.assert_array_equal(gguf.quants.dequantize(want[6], gguf.GGMLQuantizationType.Q4_0), np.zeros(32))


def test_q4_0_refuses_rows_of_partial_blocks():
    from jaxtune.quant import quantize_q4_0

    with pytest.raises(ValueError, match="rows of whole 32-weight blocks; a row has 48 weights"):
        quantize_q4_0(np.zeros((2, 48), np.float32))


@pytest.mark.gpu
def test_q4_0_bytes_equal_ggmls_on_the_gpu_at_8b_shapes():
    """On the GPU (where a reciprocal may differ from IEEE's in the last bit, and a multiply-add may fuse) every
    block of an 8B MLP matrix (1.8M blocks) is ggml's."""
    from jaxtune.quant import quantize_q4_0

    w = np.random.default_rng(0).standard_normal((14336, 4096), dtype=np.float32)
    np.testing.assert_array_equal(quantize_q4_0(w), _gguf(w))
