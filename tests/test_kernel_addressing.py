"""Kernel operands past 32-bit offsets (pallas_kernels/addressing.py): a 2-4 GiB stack of NF4 codes is read whole
as uint16 pairs by the dequant kernels and one layer at a time by the fused matmuls, 1-byte FP8 arrays of more than
2^31 elements are split over calls; the results equal the in-place / whole-array ones and float64 numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.triton import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL

from pallas_kernels import addressing
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.fp8_quantize import quantize_blocks, quantize_rows, quantize_rows_reference
from pallas_kernels.nf4_dequant import nf4_dequantize, nf4_dequantize_reference
from pallas_kernels.nf4_matmul import MatmulTiles, nf4_matmul_dx, nf4_matmul_forward
from test_kernel_nf4 import numpy_weight, stacked_weights


def test_which_operands_are_addressable():
    """Signed 32-bit element offsets reach 2^31 elements; the lowering widens them past 4 GiB."""
    u8, bf16 = jnp.uint8, jnp.bfloat16
    assert addressing.addressable((32, 4096, 2048), u8)  # Llama-3-8B's q/o codes stack: 256 MiB
    assert not addressing.addressable((80, 8192, 4096), u8)  # Llama-3-70B's q/o codes stack: 2.5 GiB
    assert not addressing.addressable((64, 25600, 2560), u8)  # Qwen3-32B's gate/up codes stack: 3.9 GiB
    assert addressing.addressable((80, 28672, 4096), u8)  # Llama-3-70B's gate codes stack: 8.75 GiB, 64-bit
    assert addressing.addressable((2**31,), u8) and not addressing.addressable((2**31 + 1,), u8)
    assert addressing.addressable((2**31,), bf16)  # a 2-byte array past 2^31 elements is past 4 GiB
    assert addressing.addressable_rows(100, (4096,), u8) == 100
    rows = addressing.addressable_rows(600_000, (8192,), u8)  # 4.9e9 bytes: 64-bit offsets, one call
    assert rows == 600_000
    rows = addressing.addressable_rows(400_000, (8192,), u8)
    assert rows * 8192 <= 2**31 < (rows + 1) * 8192


def _custom_call_operands(text: str) -> list[str]:
    """The operand types of each Pallas custom call in an exported module."""
    return [line.split(" : (")[-1] for line in text.splitlines() if f"@{CUSTOM_CALL}(" in line]


@pytest.mark.parametrize("layers, n, half, whole", [
    (32, 4096, 2048, True),  # 8B q/o: read in place
    (80, 8192, 4096, False),  # 70B q/o (2.5 GiB): past 32-bit byte offsets
    (64, 25600, 2560, False),  # Qwen3-32B gate/up (3.9 GiB): past them too
    (80, 28672, 4096, True),  # 70B gate (8.75 GiB): 64-bit offsets, in place
])
def test_a_stack_past_32_bit_offsets_reaches_the_kernels_whole_as_pairs_or_one_layer(cuda_export, layers, n, half,
                                                                                     whole):
    """Lowered for CUDA from shapes only (nothing allocated): which codes operand each kernel gets. The dequant
    kernels (bf16 W and Wᵀ, e4m3 by permutes) read every stack whole: as bytes where 32-bit offsets reach, as
    uint16 pairs of bytes where only those do; the fused matmuls get the layer sliced out."""
    codes = jax.ShapeDtypeStruct((layers, n, half), jnp.uint8)
    absmax = jax.ShapeDtypeStruct((n, 2 * half // 64), jnp.float32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    stack, pairs, one_layer = (f"tensor<{layers}x{n}x{half}xui8>", f"tensor<{layers}x{n}x{half // 2}xui16>",
                               f"tensor<{n}x{half}xui8>")
    dequantized = {
        "W": (lambda c, a, i: nf4_dequantize(c, a, layer=i), stack if whole else pairs),
        "Wᵀ": (lambda c, a, i: nf4_dequantize(c, a, transpose=True, layer=i), stack if whole else pairs),
        "e4m3": (lambda c, a, i: nf4_dequantize(c, a, jnp.float8_e4m3fn, permute=True, layer=i), pairs),
    }
    for name, (fn, want) in dequantized.items():
        (operands,) = _custom_call_operands(cuda_export(fn, codes, absmax, layer))
        assert want in operands, (name, operands)
    fused = {
        "forward": (lambda x, c, a, i: nf4_matmul_forward(x, c, a, tiles=MatmulTiles(16, 64, 32, 4, gemv=True),
                                                           layer=i), jax.ShapeDtypeStruct((4, 2 * half), jnp.bfloat16)),
        "dx": (lambda x, c, a, i: nf4_matmul_dx(x, c, a, layer=i), jax.ShapeDtypeStruct((64, n), jnp.bfloat16)),
    }
    for name, (fn, x) in fused.items():
        (operands,) = _custom_call_operands(cuda_export(fn, x, codes, absmax, layer))
        assert (stack in operands) == whole and (one_layer in operands) == (not whole), name


@pytest.mark.parametrize("limit, dequant_reads", [(20_000, "pairs"), (10_000, "layer")])
def test_an_unaddressable_stack_read_as_pairs_or_sliced_gives_the_layers_results(monkeypatch, limit, dequant_reads):
    """With the limit lowered so a small stack (3 x 128 x 96 bytes) is past it, the dequant kernels read it as
    uint16 pairs (18,432 of them, within a limit of 20,000) or, where pairs are past the limit too, the layer
    sliced out; the fused matmuls read the layer sliced out. Every path gives bitwise the results of the stack
    read in place (limit as it is), and float64 numpy's."""
    stack, absmax, prepared = stacked_weights(128, 192)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 192)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((70, 128)), jnp.float32)
    tiles = MatmulTiles(16, 64, 32, 1)

    def run(layer, scales):
        i = jnp.int32(layer)
        return (nf4_dequantize(stack, scales, jnp.float32, layer=i, interpret=True),
                nf4_dequantize(stack, scales, jnp.bfloat16, transpose=True, layer=i, interpret=True),
                nf4_dequantize(stack, scales, jnp.float8_e4m3fn, permute=True, layer=i, interpret=True),
                nf4_matmul_forward(x, stack, scales, tiles=tiles, layer=i, interpret=True),
                nf4_matmul_dx(dy, stack, scales, tiles=tiles, layer=i, interpret=True))

    def jaxpr(fn, scales):
        return str(jax.make_jaxpr(lambda c, a: fn(c, a, layer=jnp.int32(0), interpret=True))(stack, scales))

    for layer in (0, 2):
        for scales in (absmax[layer], prepared):
            in_place = run(layer, scales)
            with monkeypatch.context() as patch:
                patch.setattr(addressing, "OFFSET_LIMIT", limit)
                dequant = jaxpr(nf4_dequantize, scales)
                assert ("u16[3,128,48]" in dequant) == (dequant_reads == "pairs")  # the whole stack, as pairs
                assert ("dynamic_slice" in dequant) == (dequant_reads == "layer")
                assert "dynamic_slice" in jaxpr(lambda c, a, **kw: nf4_matmul_forward(x, c, a, tiles=tiles, **kw),
                                                 scales)
                limited = run(layer, scales)
            for got, want in zip(limited, in_place):
                np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        w = numpy_weight(stack[layer], absmax[layer])
        np.testing.assert_allclose(np.asarray(limited[0], np.float64), w, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(limited[1], np.float64), w.T, rtol=1e-2, atol=1e-7)
        np.testing.assert_allclose(np.asarray(limited[3], np.float64), np.asarray(x, np.float64) @ w.T,
                                   atol=2e-6 * np.abs(w).sum(1).max() * float(jnp.abs(x).max()))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_row_quantizer_splits_an_unaddressable_output_over_calls(monkeypatch, fmt):
    """100 rows of 64 with at most 30 rows' elements per call (30, 30, 30, 10): the reference's bits."""
    a = jnp.asarray(np.random.default_rng(1).standard_normal((4, 25, 64)) * 3, jnp.float32)
    monkeypatch.setattr(addressing, "OFFSET_LIMIT", 30 * 64 + 5)
    q, scale = quantize_rows(a, fmt, interpret=True)
    q_ref, scale_ref = quantize_rows_reference(a, fmt)
    assert q.shape == a.shape and scale.shape == (4, 25, 1)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(q_ref).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(scale_ref))


def test_fp8_matmul_splits_an_unaddressable_input_over_calls(monkeypatch):
    """a of 130 x 128 e4m3 at 64 rows per call (64, 64, 2): the whole-call result, and float64 numpy's within
    rounding; a b past the limit is refused."""
    rng = np.random.default_rng(2)
    aq, sa = quantize_blocks(jnp.asarray(rng.standard_normal((130, 128)), jnp.float32), 64)
    bq, sb = quantize_blocks(jnp.asarray(rng.standard_normal((64, 128)) * 0.05, jnp.float32), 64)
    whole = fp8_matmul(aq, sa, bq, sb, out_dtype=jnp.float32, interpret=True)
    monkeypatch.setattr(addressing, "OFFSET_LIMIT", 64 * 128)
    split = fp8_matmul(aq, sa, bq, sb, out_dtype=jnp.float32, interpret=True)
    np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))
    a64 = np.asarray(aq, np.float64) * np.repeat(np.asarray(sa, np.float64), 64, axis=1)
    b64 = np.asarray(bq, np.float64) * np.repeat(np.asarray(sb, np.float64), 64, axis=1)
    np.testing.assert_allclose(np.asarray(split, np.float64), a64 @ b64.T, atol=1e-5 * np.abs(a64 @ b64.T).max())
    with pytest.raises(ValueError, match="2\\^31"):
        fp8_matmul(aq, sa, jnp.concatenate([bq] * 2), jnp.concatenate([sb] * 2), interpret=True)


@pytest.mark.gpu
def test_last_layer_of_a_70b_sized_stack_on_gpu():
    """Llama-3-70B's q_proj codes stacked over 80 layers (2.5 GiB): the last layer through the dequant and fused
    kernels equals the jnp reference on that layer's own codes."""
    n, half, layers = 8192, 4096, 80
    key = jax.random.key(0)
    stack = jax.random.randint(key, (layers, n, half), 0, 256, jnp.int32).astype(jnp.uint8)
    absmax = jax.random.uniform(jax.random.key(1), (n, 2 * half // 64), jnp.float32, 0.01, 0.1)
    x = jax.random.normal(jax.random.key(2), (4, 2 * half), jnp.bfloat16)
    for layer in (layers - 1, layers // 2):
        want = nf4_dequantize_reference(stack[layer], absmax)
        got = jax.jit(lambda s, a, i: nf4_dequantize(s, a, layer=i))(stack, absmax, jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        y = jax.jit(lambda x, s, a, i: nf4_matmul_forward(x, s, a, tiles=MatmulTiles(16, 64, 32, 4, gemv=True),
                                                          layer=i))(x, stack, absmax, jnp.int32(layer))
        y_want = jnp.dot(x.astype(jnp.float32), want.astype(jnp.float32).T)
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_want), rtol=2e-2,
                                   atol=2e-2 * float(jnp.abs(y_want).max()))


# every pair of (output dtype, way of writing W, block and table) once: 9 cases instead of the 18 of all triples
PAIRS_CASES = [(dtype, *layout, *[(64, "gather"), (32, "select")][(i + j) % 2])
               for i, dtype in enumerate([jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
               for j, layout in enumerate([(False, True), (False, False), (True, True)])]


@pytest.mark.parametrize("dtype, transpose, interleave, block_bytes, lut", PAIRS_CASES)
def test_codes_read_as_pairs_dequantize_bitwise_as_bytes(dtype, transpose, interleave, block_bytes, lut):
    """The pairs kernel (W interleaved in registers or by strided stores, Wᵀ, one or two 64-blocks per tile, table or
    select tree) gives the byte kernel's bits on a stack read at a layer and on a single weight; float64 numpy's
    values."""
    stack, absmax, prepared = stacked_weights(192, 320)
    kw = dict(block_bytes=block_bytes, lut=lut, transpose=transpose, interleave=interleave, interpret=True)
    for layer, scales in ((1, prepared), (2, absmax[2])):
        want = nf4_dequantize(stack, scales, dtype, layer=jnp.int32(layer), **kw)
        got = nf4_dequantize(stack, scales, dtype, layer=jnp.int32(layer), pairs=True, **kw)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    single = nf4_dequantize(stack[0], absmax[0], dtype, pairs=True, **kw)
    w = numpy_weight(stack[0], absmax[0])
    np.testing.assert_allclose(np.asarray(single, np.float64), w.T if transpose else w,
                               rtol=1e-6 if dtype == jnp.float32 else 0.07, atol=1e-7 if dtype == jnp.float32 else 0.02)


@pytest.mark.parametrize("transpose, interleave", [(False, True), (False, False), (True, True)])
def test_pairs_kernels_lower_for_cuda(cuda_export, transpose, interleave):
    """Every way of writing W (or Wᵀ) from pairs lowers for an H100 (Triton's 2-operand joins, strided stores)."""
    codes = jax.ShapeDtypeStruct((3, 256, 512), jnp.uint8)
    absmax = jax.ShapeDtypeStruct((3, 16, 256), jnp.float32)
    text = cuda_export(lambda c, a, i: nf4_dequantize(c, a, transpose=transpose, interleave=interleave, layer=i,
                                                      pairs=True), codes, absmax, jax.ShapeDtypeStruct((), jnp.int32))
    (operands,) = _custom_call_operands(text)
    assert "tensor<3x256x256xui16>" in operands
