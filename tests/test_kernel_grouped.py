"""The grouped expert GEMM kernel (pallas_kernels/grouped_matmul.py): interpret mode against float64 on ragged
tilings (empty experts, unused tiles, experts of many tiles), its gradients, and its lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import (GroupedTiles, grouped_matmul, grouped_matmul_tiles,
                                           grouped_matmul_tiles_reference, grouped_matmul_trainable,
                                           grouped_weight_grad, grouped_weight_grad_reference, sum_per_expert)
from test_kernel_dispatch import all_eqns


def _case(seed: int, tiles: int, bm: int, k: int, n: int, experts: int):
    rng = np.random.default_rng(seed)
    tile_group = np.sort(rng.integers(0, experts, tiles))  # experts in order, some of several tiles, some none
    tile_group[-max(1, tiles // 4):] = -1  # the unused tail
    x = rng.standard_normal((tiles * bm, k)).astype(np.float32)
    w = rng.standard_normal((experts, n, k)).astype(np.float32)
    dy = rng.standard_normal((tiles * bm, n)).astype(np.float32)
    return tile_group, x, w, dy


def _per_tile(a: np.ndarray, tile_group: np.ndarray, bm: int, fn) -> np.ndarray:
    out = []
    for i, g in enumerate(tile_group):
        out.append(fn(a[i * bm:(i + 1) * bm].astype(np.float64), g))
    return np.concatenate(out)


@pytest.mark.parametrize("tiles, bm, k, n, experts, tile", [
    (6, 16, 64, 32, 3, GroupedTiles(16, 16, 32)),
    (9, 16, 128, 64, 5, GroupedTiles(16, 32, 64)),
    (4, 32, 32, 16, 2, GroupedTiles(32, 16, 16)),  # LoRA-like: a rank-16 output
])
def test_grouped_kernel_and_its_gradients_equal_float64(tiles, bm, k, n, experts, tile):
    tile_group, x, w, dy = _case(tiles * k, tiles, bm, k, n, experts)
    w64 = w.astype(np.float64)
    want = _per_tile(x, tile_group, bm, lambda a, g: a @ w64[g].T if g >= 0 else np.zeros((bm, n)))
    with jax.default_matmul_precision("highest"):
        got = grouped_matmul_tiles(jnp.asarray(x), jnp.asarray(w), jnp.asarray(tile_group), tiles=tile, interpret=True)
        ref = grouped_matmul_tiles_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(tile_group), bm)
        # frozen weight: dx only; trainable (LoRA): dx and dW[e] summed over e's tiles
        _, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, jnp.asarray(tile_group), tile, True), x, w)
        dx, dw_frozen = vjp(jnp.asarray(dy))
        _, vjp = jax.vjp(lambda x, w: grouped_matmul_trainable(x, w, jnp.asarray(tile_group), tile, True), x, w)
        dx_t, dw = vjp(jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)
    want_dx = _per_tile(dy, tile_group, bm, lambda a, g: a @ w64[g] if g >= 0 else np.zeros((bm, k)))
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx_t), want_dx, rtol=1e-5, atol=1e-4)
    assert not np.asarray(dw_frozen).any()
    want_dw = np.zeros((experts, n, k))
    for i, g in enumerate(tile_group):
        if g >= 0:
            want_dw[g] += dy[i * bm:(i + 1) * bm].astype(np.float64).T @ x[i * bm:(i + 1) * bm].astype(np.float64)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tokens, tiles, bm, k, n, experts", [(11, 6, 16, 64, 32, 3), (40, 9, 16, 128, 64, 5)])
def test_the_gathering_kernel_reads_each_rows_token_by_index(tokens, tiles, bm, k, n, experts):
    """With row_token the kernel loads row r of each tile from the token array at row_token[r] (a token count that
    is no power of two, tokens read by several rows): the product of the gathered rows, in interpret mode against
    float64, and the jnp reference alike."""
    tile_group, _, w, _ = _case(tokens + k, tiles, bm, k, n, experts)
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    row_token = rng.integers(0, tokens, tiles * bm).astype(np.int32)
    want = _per_tile(x[row_token], tile_group, bm, lambda a, g: a @ w[g].astype(np.float64).T if g >= 0
                     else np.zeros((bm, n)))
    with jax.default_matmul_precision("highest"):
        got = grouped_matmul_tiles(jnp.asarray(x), jnp.asarray(w), jnp.asarray(tile_group), interpret=True,
                                   tiles=GroupedTiles(bm, 32, 32), row_token=jnp.asarray(row_token))
        ref = grouped_matmul_tiles_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(tile_group), bm,
                                             row_token=jnp.asarray(row_token))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)


def test_grouped_kernel_refuses_shapes_its_tiles_do_not_divide():
    x, w, groups = jnp.zeros((48, 64)), jnp.zeros((2, 32, 64)), jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="multiple of block_m"):
        grouped_matmul_tiles(x, w, groups, tiles=GroupedTiles(32, 16, 16), interpret=True)
    with pytest.raises(ValueError, match="does not contract"):
        grouped_matmul_tiles(jnp.zeros((48, 32)), w, groups, tiles=GroupedTiles(16, 16, 16), interpret=True)


@pytest.mark.parametrize("m, k, n, experts", [(1152, 2048, 768, 128), (256, 768, 2048, 128), (128, 2048, 16, 8)])
def test_grouped_kernel_lowers_for_cuda(cuda_export, m, k, n, experts):
    """Qwen3-30B-A3B's expert shapes (gate/up, down) and a LoRA factor's, forward and input gradient."""
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((experts, n, k), jnp.bfloat16)
    groups = jax.ShapeDtypeStruct((m // GroupedTiles().block_m,), jnp.int32)

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x: grouped_matmul(x, w, g, GroupedTiles(), False), x)
        return y, vjp(y)[0]

    text = cuda_export(step, x, w, groups)
    assert text.count("grouped_matmul") >= 2, "forward and input-gradient kernels"
    tokens = jax.ShapeDtypeStruct((m // 8 + 3, k), jnp.bfloat16)  # the routed rows' tokens, loaded by index
    row_token = jax.ShapeDtypeStruct((m,), jnp.int32)
    text = cuda_export(lambda t, w, g, r: grouped_matmul_tiles(t, w, g, row_token=r), tokens, w, groups, row_token)
    assert "grouped_matmul_gathered" in text


@pytest.mark.gpu
def test_grouped_kernel_on_the_gpu_equals_float64_at_expert_shapes():
    """On the GPU (where an out-of-bounds read is not clamped as in interpret mode): Qwen3-30B-A3B's expert
    shapes over many tiles and column blocks, forward and input gradient."""
    tile_group, x, w, dy = _case(7, 40, 64, 256, 384, 16)
    w64 = w.astype(np.float64)
    tiles = GroupedTiles(block_m=64)  # 384 columns: the 256-column tile fitted to 128
    got = grouped_matmul_tiles(jnp.asarray(x), jnp.asarray(w), jnp.asarray(tile_group), tiles=tiles)
    want = _per_tile(x, tile_group, 64, lambda a, g: a @ w64[g].T if g >= 0 else np.zeros((64, 384)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    dx = grouped_matmul_tiles(jnp.asarray(dy), jnp.asarray(w), jnp.asarray(tile_group), transpose=True, tiles=tiles)
    want_dx = _per_tile(dy, tile_group, 64, lambda a, g: a @ w64[g] if g >= 0 else np.zeros((64, 256)))
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=2e-2, atol=2e-2 * np.abs(want_dx).max())


def test_a_16bit_factors_gradient_is_summed_per_expert_on_tensor_cores():
    """bf16 LoRA factors: each expert's dW (its tiles' products summed by the one-hot GEMM) comes from bf16 GEMMs
    accumulating in float32, with no float32 operand (that GEMM runs off the tensor cores), and equals float64 of
    the same bf16 inputs to about 16 bits (the float32 sums split into a bf16 high part and remainder)."""
    tiles, bm, k, n, experts = 9, 16, 64, 16, 4
    tile_group, x, w, dy = _case(tiles * k, tiles, bm, k, n, experts)
    x, w, dy = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))
    tg = jnp.asarray(tile_group)
    fn = lambda x, w: grouped_matmul_trainable(x, w, tg, GroupedTiles(bm, 16, 32), True)  # noqa: E731
    backward = jax.make_jaxpr(lambda x, w, dy: jax.vjp(fn, x, w)[1](dy))(x, w, dy)
    dots = [e for e in all_eqns(backward.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), backward
    _, dw = jax.vjp(fn, x, w)[1](dy)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    want = np.zeros((experts, n, k))
    for i, g in enumerate(tile_group):
        if g >= 0:
            want[g] += dy64[i * bm:(i + 1) * bm].T @ x64[i * bm:(i + 1) * bm]
    np.testing.assert_allclose(np.asarray(dw, np.float64), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
    # the sum itself before the 16-bit cast: about 16 bits of float64's
    per_tile = jnp.asarray(np.random.default_rng(1).standard_normal((tiles, 3, 5)), jnp.float32)
    got = sum_per_expert(per_tile, tg, experts)
    want_sum = np.zeros((experts, 3, 5))
    for i, g in enumerate(tile_group):
        if g >= 0:
            want_sum[g] += np.asarray(per_tile[i], np.float64)
    np.testing.assert_allclose(np.asarray(got), want_sum, rtol=0, atol=1e-4)
    np.testing.assert_allclose(np.asarray(sum_per_expert(per_tile, tg, experts, full=True)), want_sum, atol=1e-6)


@pytest.mark.parametrize("tiles, bm, n, k, experts, blocks", [
    (9, 16, 16, 64, 5, (16, 32)),  # LoRA's A: rank rows, every input column
    (7, 32, 96, 16, 3, (32, 16)),  # LoRA's B: output rows (no power of two: the block fitted), rank columns
    (12, 16, 32, 48, 6, (64, 64)),  # experts with no tiles, one with many; blocks larger than the sizes
])
def test_weight_grad_kernel_sums_each_experts_tiles_as_float64(tiles, bm, n, k, experts, blocks):
    """The per-expert weight gradient kernel (interpret mode) against float64: each expert's dW is the sum over
    its tiles of dyᵀ x, an expert with no tiles gets zeros, unused tiles (-1) count for none; float32 and bf16
    inputs; the jnp reference alike; and the trainable GEMM's backward through the kernel gives the same dW."""
    tile_group, x, _, _ = _case(tiles * 7 + n, tiles, bm, k, n, experts)
    dy = np.random.default_rng(n).standard_normal((tiles * bm, n)).astype(np.float32)
    want = np.zeros((experts, n, k))
    for i, g in enumerate(tile_group):
        if g >= 0:
            want[g] += dy[i * bm:(i + 1) * bm].astype(np.float64).T @ x[i * bm:(i + 1) * bm].astype(np.float64)
    tg = jnp.asarray(tile_group)
    got = grouped_weight_grad(jnp.asarray(dy), jnp.asarray(x), tg, experts, bm, block_n=blocks[0], block_k=blocks[1],
                              interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)
    assert not np.asarray(got)[[e for e in range(experts) if e not in tile_group]].any()
    ref = grouped_weight_grad_reference(jnp.asarray(dy), jnp.asarray(x), tg, experts, bm)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)
    half = [jnp.asarray(a, jnp.bfloat16) for a in (dy, x)]
    want16 = np.zeros((experts, n, k))
    d16, x16 = (np.asarray(a, np.float64) for a in half)
    for i, g in enumerate(tile_group):
        if g >= 0:
            want16[g] += d16[i * bm:(i + 1) * bm].T @ x16[i * bm:(i + 1) * bm]
    got16 = grouped_weight_grad(*half, tg, experts, bm, block_n=blocks[0], block_k=blocks[1], interpret=True)
    np.testing.assert_allclose(np.asarray(got16), want16, rtol=1e-5, atol=1e-4)


def test_the_trainable_gemm_backward_through_the_weight_grad_kernel(monkeypatch):
    """With the kernel switched on, the LoRA factor's gradient through `grouped_matmul_trainable` is unchanged."""
    import pallas_kernels.grouped_matmul as grouped

    tile_group, x, w, dy = _case(5, 9, 16, 64, 16, 4)
    fn = lambda x, w: grouped_matmul_trainable(x, w, jnp.asarray(tile_group), GroupedTiles(16, 16, 32), True)  # noqa
    with jax.default_matmul_precision("highest"):
        before = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))[1](jnp.asarray(dy))
        monkeypatch.setattr(grouped, "WEIGHT_GRAD_KERNEL", True)
        jaxpr = str(jax.make_jaxpr(lambda x, w, dy: jax.vjp(fn, x, w)[1](dy))(x, w, dy))
        after = jax.vjp(fn, jnp.asarray(x), jnp.asarray(w))[1](jnp.asarray(dy))
    assert "grouped_weight_grad" in jaxpr
    for b, a in zip(before, after):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m, n, k, experts", [(2304, 16, 2048, 128), (2304, 768, 16, 128), (256, 2048, 16, 8)])
def test_weight_grad_kernel_lowers_for_cuda(cuda_export, m, n, k, experts):
    """LoRA's factor gradients at Qwen3-30B-A3B's expert shapes (A of gate/up, B of gate/up, B of down)."""
    dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    groups = jax.ShapeDtypeStruct((m // 128,), jnp.int32)
    text = cuda_export(lambda d, x, g: grouped_weight_grad(d, x, g, experts, 128), dy, x, groups)
    assert "grouped_weight_grad" in text
