"""NF4 arrays byte-identical to bitsandbytes (CPU), and dequantization identical to bnb's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from bitsandbytes import functional as F

from jaxtune.quant import nf4
from jaxtune.errors import CheckpointError

# numel 17*320 = 5440 is not a multiple of 64*256: the last nested block is partial
SHAPES = [(128, 64), (96, 192), (300, 128), (17, 320), (512, 1024)]


def _bnb_state(w: np.ndarray):
    q, st = F.quantize_4bit(torch.from_numpy(w), blocksize=64, compress_statistics=True, quant_type="nf4")
    tensors = {k: v.numpy() for k, v in st.as_dict(packed=True).items()}
    tensors["weight"] = q.numpy()
    return q, st, tensors




@pytest.mark.parametrize("shape", SHAPES)
def test_codes_absmax_and_nested_state_identical_to_bitsandbytes(shape):
    rng = np.random.default_rng(shape[0] * shape[1])
    w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    q_ref, st, ref = _bnb_state(w)
    ours = nf4.to_bnb_tensors(nf4.quantize(w, nested_map=st.state2.code.numpy()))
    # 4-bit codes, packed high-nibble-first, byte for byte
    np.testing.assert_array_equal(ours["weight"], ref["weight"])
    np.testing.assert_array_equal(ours["quant_map"], ref["quant_map"])
    # offset = mean(absmax): same float32 value as torch's reduction here (both close to the exact mean)
    ours_state = json.loads(bytes(ours["quant_state.bitsandbytes__nf4"]))
    ref_state = json.loads(bytes(ref["quant_state.bitsandbytes__nf4"]))
    np.testing.assert_allclose(ours_state["nested_offset"], ref_state["nested_offset"], rtol=2e-7)
    assert {k: v for k, v in ours_state.items() if k not in ("nested_offset", "dtype")} == {
        k: v for k, v in ref_state.items() if k not in ("nested_offset", "dtype")
    }
    # double quantization of absmax: bnb's nearest-code blockwise quantizer on the same fp32 inputs
    absmax = torch.from_numpy(np.abs(w.reshape(-1, 64)).max(axis=1))
    ref_codes, ref_nested = torch.ops.bitsandbytes.quantize_blockwise(
        (absmax - st.offset).double(), st.state2.code, 256
    )
    ours_exact = nf4.to_bnb_tensors(nf4.quantize(w, offset=float(st.offset), nested_map=st.state2.code.numpy()))
    np.testing.assert_array_equal(ours_exact["absmax"], ref_codes.numpy())
    np.testing.assert_array_equal(ours_exact["nested_absmax"], ref_nested.numpy())
    np.testing.assert_array_equal(ours_exact["nested_absmax"], ref["nested_absmax"])
    # the native bnb CPU absmax codes differ from nearest rounding by at most one code, on few blocks
    diff = np.abs(ours_exact["absmax"].astype(int) - ref["absmax"].astype(int))
    assert diff.max() <= 1 and diff.mean() < 0.01


def test_dynamic_map_within_one_ulp_of_bitsandbytes():
    np.testing.assert_allclose(nf4.dynamic_map(), F.create_dynamic_map(signed=True).numpy(), rtol=2e-7, atol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_identical_to_bitsandbytes(shape):
    rng = np.random.default_rng(7 + shape[0])
    w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    q, st, tensors = _bnb_state(w)
    ref = F.dequantize_4bit(q, st).numpy()
    np.testing.assert_array_equal(nf4.from_bnb(tensors, shape), ref)


def test_bnb_bytes_round_trip_exactly():
    w = (np.random.default_rng(0).standard_normal((64, 256)) * 0.02).astype(np.float32)
    _, _, tensors = _bnb_state(w)
    again = nf4.to_bnb_tensors(nf4.from_bnb_tensors(tensors, (64, 256)), dtype="float32")
    for name in nf4.BNB_TENSOR_NAMES:
        np.testing.assert_array_equal(again[name], tensors[name], err_msg=name)


def test_own_quantization_error_is_nf4_sized():
    w = (np.random.default_rng(1).standard_normal((256, 512)) * 0.02).astype(np.float32)
    deq = nf4.from_bnb(nf4.to_bnb(w), w.shape)
    rel = np.linalg.norm(deq - w) / np.linalg.norm(w)
    assert 0.05 < rel < 0.12, rel  # 4-bit NF4 on Gaussian weights: ~9% relative error


def test_bad_quant_state_json_is_a_clear_error():
    w = (np.random.default_rng(2).standard_normal((64, 64))).astype(np.float32)
    tensors = nf4.to_bnb(w)
    tensors["quant_state.bitsandbytes__nf4"] = np.frombuffer(b"{not json", np.uint8)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        nf4.from_bnb(tensors, (64, 64))


def test_shape_mismatch_and_bad_shapes_are_clear_errors():
    tensors = nf4.to_bnb(np.ones((64, 128), np.float32))
    with pytest.raises(CheckpointError, match=r"does not match the expected \(128, 64\)"):
        nf4.from_bnb(tensors, (128, 64))
    with pytest.raises(ValueError, match="multiple of 64"):
        nf4.quantize(np.ones((8, 100), np.float32))


def test_absmax_dequantization_builds_no_index_tables():
    """Each nested scale covers 256 blocks: a broadcast. A `jnp.repeat` there lowers to cumsum/scatter index
    tables over every block that XLA constant-folds for seconds per 8B-sized weight at compile time."""
    import jax
    import jax.numpy as jnp

    from jaxtune.quant import nf4

    blocks = 14336 * 4096 // nf4.BLOCK
    args = (jax.ShapeDtypeStruct((blocks,), jnp.uint8), jax.ShapeDtypeStruct((blocks // 256,), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.float32))
    hlo = jax.jit(lambda c, n, o, m: nf4.dequantize_absmax(nf4.NF4Weight(c, c, n, o, m))).lower(*args).as_text()
    assert "reduce_window" not in hlo and "scatter" not in hlo and "cumsum" not in hlo
