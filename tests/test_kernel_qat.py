"""The one-pass QAT q4_0 weight kernel (pallas_kernels/qat_q4_0.py) in interpret mode against llama.cpp's q4_0
(the `gguf` package's numpy reference) of the merged weight formed in float64, and lowered for CUDA."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas.triton import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL

from pallas_kernels.nf4_tiles import NF4_VALUES
from pallas_kernels.qat_q4_0 import qat_q4_0_weight

Q4_0 = gguf.GGMLQuantizationType.Q4_0


def _operands(rng, n: int, k: int, r: int, layers: int | None = None):
    lead = () if layers is None else (layers,)
    codes = rng.integers(0, 256, (*lead, n, k // 2)).astype(np.uint8)
    absmax = rng.uniform(0.005, 0.08, (*lead, n, k // 64)).astype(np.float32)
    a = (rng.normal(size=(*lead, r, k)) * 0.2).astype(np.float32)
    b = (rng.normal(size=(*lead, n, r)) * 0.2).astype(np.float32)
    return codes, absmax, a, b


def _llama_cpp_read_back(codes, absmax, a, b, scale: float) -> np.ndarray:
    """q4_0 of NF4 W + scale * B @ A formed in float64 (then float32, what the quantizer takes), read back by
    the `gguf` package, in bf16."""
    n = codes.shape[0]
    values = np.asarray(NF4_VALUES, np.float64)[np.stack([codes >> 4, codes & 15], axis=-1).reshape(n, -1)]
    w = (values.reshape(n, -1, 64) * absmax[..., None].astype(np.float64)).reshape(n, -1)
    w = (w + scale * (b.astype(np.float64) @ a.astype(np.float64))).astype(np.float32)
    back = gguf.quants.dequantize(gguf.quants.quantize(w, Q4_0), Q4_0).reshape(w.shape)
    return back.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32), w


def _assert_q4_0_read_back(got: np.ndarray, want: np.ndarray, merged: np.ndarray) -> None:
    """Equal to llama.cpp's read-back but for weights on a rounding edge (the merged weight in float32 may differ
    from float64's by its last bit there): at most 0.1% of them, each one code step (its block's d) away."""
    got = np.asarray(got, np.float32)
    differ = got != want
    assert differ.mean() <= 1e-3, f"{differ.sum()} of {differ.size} weights differ"
    blocks = merged.reshape(merged.shape[0], -1, 32)
    step = np.abs(blocks[np.arange(blocks.shape[0])[:, None], np.arange(blocks.shape[1])[None],
                         np.abs(blocks).argmax(-1)]) / 8
    step = np.repeat(step, 32, axis=1)
    assert np.all(np.abs(got - want)[differ] <= 1.01 * step[differ] + 1e-6)


@pytest.mark.parametrize("n,k,r", [(64, 128, 16), (192, 384, 8), (128, 256, 4), (64, 1024, 24), (256, 192, 64)])
def test_qat_q4_0_weight_is_llama_cpp_q4_0_of_the_merged_weight(n, k, r):
    rng = np.random.default_rng(n + k + r)
    codes, absmax, a, b = _operands(rng, n, k, r)
    scale = 16 / r
    got = qat_q4_0_weight(jnp.asarray(a), jnp.asarray(b), jnp.asarray(codes), jnp.asarray(absmax), scale=scale,
                          interpret=True)
    assert got.shape == (n, k) and got.dtype == jnp.bfloat16
    want, merged = _llama_cpp_read_back(codes, absmax, a, b, scale)
    _assert_q4_0_read_back(got, want, merged)


def test_qat_q4_0_weight_keeps_a_blocks_first_largest_magnitude_on_ties():
    """A block whose largest magnitude comes twice with opposite signs: ggml takes the first one's sign (d's sign
    decides which end of the 16 codes is exact). Zero adapters, so the weight is NF4's: +-1 * absmax."""
    codes = np.full((64, 64), 0x77, np.uint8)  # NF4 code 7 is 0.0
    codes[0, 0] = 0x0F  # weight 0: -1, weight 1: +1 (one block)
    codes[1, 0] = 0xF0  # weight 0: +1, weight 1: -1
    absmax = np.full((64, 2), 0.5, np.float32)
    a, b = np.zeros((16, 128), np.float32), np.zeros((64, 16), np.float32)
    got = np.asarray(qat_q4_0_weight(jnp.asarray(a), jnp.asarray(b), jnp.asarray(codes), jnp.asarray(absmax),
                                     scale=1.0, interpret=True), np.float32)
    want, merged = _llama_cpp_read_back(codes, absmax, a, b, 1.0)
    np.testing.assert_array_equal(got, want)
    assert got[0, 0] == -0.5 and got[0, 1] == 0.5 * 7 / 8 and got[1, 0] == 0.5 and got[1, 1] == -0.5 * 7 / 8


@pytest.mark.parametrize("prepared", [False, True])
def test_qat_q4_0_weight_reads_a_layer_of_a_stack_in_place(prepared):
    rng = np.random.default_rng(3)
    codes, absmax, a, b = _operands(rng, 128, 256, 8, layers=3)
    scales = np.swapaxes(absmax, -1, -2) if prepared else absmax[1]
    got = qat_q4_0_weight(jnp.asarray(a[1]), jnp.asarray(b[1]), jnp.asarray(codes), jnp.asarray(scales), scale=2.0,
                          layer=jnp.int32(1), interpret=True)
    want = qat_q4_0_weight(jnp.asarray(a[1]), jnp.asarray(b[1]), jnp.asarray(codes[1]), jnp.asarray(absmax[1]),
                           scale=2.0, interpret=True)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_qat_q4_0_weight_refuses_factors_that_do_not_fit():
    codes, absmax = jnp.zeros((64, 64), jnp.uint8), jnp.ones((64, 2), jnp.float32)
    with pytest.raises(ValueError, match="LoRA factors"):
        qat_q4_0_weight(jnp.zeros((8, 64)), jnp.zeros((64, 8)), codes, absmax, scale=1.0, interpret=True)


@pytest.mark.parametrize("n,k,r", [(4096, 4096, 16), (1024, 4096, 16), (14336, 4096, 8), (4096, 14336, 64),
                                   (576, 1536, 16)])
def test_qat_q4_0_weight_lowers_for_cuda(cuda_export, n, k, r):
    a, b = jax.ShapeDtypeStruct((r, k), jnp.float32), jax.ShapeDtypeStruct((n, r), jnp.float32)
    codes, absmax = jax.ShapeDtypeStruct((n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((n, k // 64), jnp.float32)
    text = cuda_export(lambda a, b, c, s: qat_q4_0_weight(a, b, c, s, scale=2.0), a, b, codes, absmax)
    assert text.count(f"@{CUSTOM_CALL}(") == 1 and "mul.rn.f32" in text
    stack, layer = jax.ShapeDtypeStruct((32, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((), jnp.int32)
    prepared = jax.ShapeDtypeStruct((32, k // 64, n), jnp.float32)
    text = cuda_export(lambda a, b, c, s, i: qat_q4_0_weight(a, b, c, s, scale=2.0, layer=i), a, b, stack, prepared,
                       layer)
    assert text.count(f"@{CUSTOM_CALL}(") == 1
