"""The grouped FP8 expert GEMM (pallas_kernels/grouped_fp8_matmul.py): interpret mode against float64 of the
dequantized e4m3 operands on ragged tilings (empty experts, unused tiles, experts of many tiles), the input gradient
through its custom VJP, the error against the unquantized product, and its lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_fp8_matmul import (GroupedFp8Tiles, fp8_expert_weights, grouped_fp8_matmul,
                                               grouped_fp8_matmul_reference, grouped_fp8_matmul_tiles)
from pallas_kernels.fp8_quantize import quantize_rows_reference


def _case(seed: int, tiles: int, bm: int, k: int, n: int, experts: int):
    rng = np.random.default_rng(seed)
    tile_group = np.sort(rng.integers(0, experts, tiles))  # experts in order, some of several tiles, some none
    tile_group[-max(1, tiles // 4):] = -1  # the unused tail
    x = rng.standard_normal((tiles * bm, k)).astype(np.float32) * rng.uniform(0.1, 10, (tiles * bm, 1))
    w = (0.05 * rng.standard_normal((experts, n, k))).astype(np.float32)
    dy = rng.standard_normal((tiles * bm, n)).astype(np.float32)
    return tile_group, x, w, dy


def _per_tile(a: np.ndarray, tile_group: np.ndarray, bm: int, width: int, fn) -> np.ndarray:
    return np.concatenate([fn(a[i * bm:(i + 1) * bm], g) if g >= 0 else np.zeros((bm, width))
                           for i, g in enumerate(tile_group)])


def _dequantized(q, scale):
    return np.asarray(q.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)[..., None]


@pytest.mark.parametrize("tiles, bm, k, n, experts, tile", [
    (6, 16, 64, 32, 3, GroupedFp8Tiles(16, 16, 32)),
    (9, 16, 128, 64, 5, GroupedFp8Tiles(16, 32, 64)),
    (5, 32, 160, 96, 4, GroupedFp8Tiles(32, 64, 64)),  # K and N that the preferred tiles do not divide
])
def test_grouped_fp8_kernel_and_its_input_gradient_equal_float64(tiles, bm, k, n, experts, tile):
    tile_group, x, w, dy = _case(tiles * k, tiles, bm, k, n, experts)
    frozen = fp8_expert_weights(jnp.asarray(w))
    wq, w_scale, wtq, wt_scale = frozen
    w_deq, wt_deq = _dequantized(wq, w_scale), _dequantized(wtq, wt_scale)
    np.testing.assert_allclose(np.swapaxes(wt_deq, 1, 2), w, rtol=2 ** -3, atol=1e-6)  # e4m3: 3 mantissa bits
    xq, x_scale = quantize_rows_reference(jnp.asarray(x))
    x_deq = _dequantized(xq, x_scale[:, 0])
    want = _per_tile(x_deq, tile_group, bm, n, lambda a, g: a @ w_deq[g].T)
    groups = jnp.asarray(tile_group)
    got = grouped_fp8_matmul_tiles(xq, x_scale[:, 0], wq, w_scale, groups, tiles=tile, out_dtype=jnp.float32,
                                   interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    ref = grouped_fp8_matmul_reference(xq, x_scale[:, 0], wq, w_scale, groups, bm, jnp.float32)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # the custom VJP: dx = (dy in e4m3 rows) @ Wᵀ in e4m3, the weights' cotangents zero
    y, vjp = jax.vjp(lambda x, f: grouped_fp8_matmul(x, f, groups, tile, "pallas-interpret"), jnp.asarray(x), frozen)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    dx, dfrozen = vjp(jnp.asarray(dy))
    gq, g_scale = quantize_rows_reference(jnp.asarray(dy))
    want_dx = _per_tile(_dequantized(gq, g_scale[:, 0]), tile_group, bm, k, lambda a, g: a @ wt_deq[g].T)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-5 * np.abs(want_dx).max())
    assert not any(np.asarray(d.astype(jnp.float32)).any() for d in dfrozen)
    # against the unquantized product: e4m3's rounding of both operands, a few percent
    exact = _per_tile(x.astype(np.float64), tile_group, bm, n, lambda a, g: a @ w[g].astype(np.float64).T)
    assert np.abs(np.asarray(y) - exact).max() < 0.1 * np.abs(exact).max()


def test_the_gathering_fp8_kernel_reads_each_rows_token_by_index():
    """row_token: the e4m3 rows and their scales are the tokens', row r read at row_token[r] inside the kernel."""
    tile_group, _, w, _ = _case(3, 6, 16, 64, 32, 3)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((21, 64)).astype(np.float32)
    row_token = jnp.asarray(rng.integers(0, 21, 96), jnp.int32)
    xq, x_scale = quantize_rows_reference(jnp.asarray(x))
    wq, w_scale, _, _ = fp8_expert_weights(jnp.asarray(w))
    w_deq = _dequantized(wq, w_scale)
    want = _per_tile(_dequantized(xq, x_scale[:, 0])[np.asarray(row_token)], tile_group, 16, 32,
                     lambda a, g: a @ w_deq[g].T)
    got = grouped_fp8_matmul_tiles(xq, x_scale[:, 0], wq, w_scale, jnp.asarray(tile_group),
                                   tiles=GroupedFp8Tiles(16, 16, 32), out_dtype=jnp.float32, interpret=True,
                                   row_token=row_token)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_grouped_fp8_kernel_refuses_what_it_cannot_take():
    wq = jnp.zeros((2, 32, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8 operands"):
        grouped_fp8_matmul_tiles(jnp.zeros((32, 64)), jnp.ones(32), wq, jnp.ones((2, 32)), jnp.zeros(2, jnp.int32),
                                 tiles=GroupedFp8Tiles(16, 16, 32), interpret=True)
    with pytest.raises(ValueError, match="multiple of block_m"):
        grouped_fp8_matmul_tiles(jnp.zeros((40, 64), jnp.float8_e4m3fn), jnp.ones(40), wq, jnp.ones((2, 32)),
                                 jnp.zeros(2, jnp.int32), tiles=GroupedFp8Tiles(16, 16, 32), interpret=True)
    with pytest.raises(ValueError, match="K must agree"):
        grouped_fp8_matmul_tiles(jnp.zeros((32, 32), jnp.float8_e4m3fn), jnp.ones(32), wq, jnp.ones((2, 32)),
                                 jnp.zeros(2, jnp.int32), tiles=GroupedFp8Tiles(16, 16, 32), interpret=True)


@pytest.mark.parametrize("m, k, n, experts", [(1152, 2048, 768, 128), (256, 768, 2048, 128), (512, 2880, 5760, 32)])
def test_grouped_fp8_kernel_lowers_for_cuda(cuda_export, m, k, n, experts):
    """Qwen3-30B-A3B's expert shapes (gate/up, down) and gpt-oss-20b's fused gate/up, forward and input gradient."""
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    frozen = (jax.ShapeDtypeStruct((experts, n, k), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((experts, n), jnp.float32),
              jax.ShapeDtypeStruct((experts, k, n), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((experts, k), jnp.float32))
    groups = jax.ShapeDtypeStruct((m // GroupedFp8Tiles().block_m,), jnp.int32)

    def step(x, frozen, g):
        y, vjp = jax.vjp(lambda x: grouped_fp8_matmul(x, frozen, g, GroupedFp8Tiles(), "pallas"), x)
        return y, vjp(y)[0]

    text = cuda_export(step, x, frozen, groups)
    assert text.count("grouped_fp8_matmul") >= 2, "forward and input-gradient kernels"
    tokens = (jax.ShapeDtypeStruct((m // 4 + 3, k), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((m // 4 + 3,), jnp.float32))
    text = cuda_export(lambda t, s, w, ws, g, r: grouped_fp8_matmul_tiles(t, s, w, ws, g, row_token=r), *tokens,
                       frozen[0], frozen[1], groups, jax.ShapeDtypeStruct((m,), jnp.int32))
    assert "grouped_fp8_matmul" in text
