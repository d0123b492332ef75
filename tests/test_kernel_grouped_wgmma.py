"""The Hopper grouped GEMM (pallas_kernels/grouped_matmul_wgmma.py, JAX's Mosaic GPU ragged dot): its reference
against float64 on uneven groups (empty ones, rows past the last group), its lowering for CUDA on this CPU, and
on a Hopper GPU the kernel itself, forward and input gradient, against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul_wgmma import (WgmmaTiles, fits, frozen_ragged_matmul, ragged_matmul,
                                                 ragged_matmul_reference)


def _case(seed: int, m: int, k: int, n: int, experts: int, used: int):
    """Rows in uneven groups (some experts empty) covering the first `used` of m rows."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, used + 1, experts - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [used]])).astype(np.int32)
    sizes[rng.integers(0, experts)] = 0  # one more empty expert, whatever the cuts gave
    sizes[-1] += used - sizes.sum()
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((experts, n, k)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    return sizes, x, w, dy


def _grouped64(a: np.ndarray, w: np.ndarray, sizes: np.ndarray, transpose: bool) -> np.ndarray:
    out = np.zeros((a.shape[0], w.shape[2] if transpose else w.shape[1]))
    start = 0
    for e, size in enumerate(sizes):
        rows = a[start:start + size].astype(np.float64)
        out[start:start + size] = rows @ (w[e].astype(np.float64) if transpose else w[e].astype(np.float64).T)
        start += size
    return out


@pytest.mark.parametrize("m, k, n, experts, used", [(96, 64, 32, 5, 80), (130, 32, 48, 3, 130), (64, 16, 16, 8, 17)])
def test_reference_equals_float64_on_uneven_groups(m, k, n, experts, used):
    sizes, x, w, dy = _case(m + k, m, k, n, experts, used)
    with jax.default_matmul_precision("highest"):
        y = ragged_matmul_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
        dx = ragged_matmul_reference(jnp.asarray(dy), jnp.asarray(w), jnp.asarray(sizes), transpose=True)
    np.testing.assert_allclose(np.asarray(y), _grouped64(x, w, sizes, False), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dx), _grouped64(dy, w, sizes, True), rtol=1e-5, atol=1e-5)


def test_refuses_shapes_its_tiles_do_not_divide():
    sizes = jnp.zeros((2,), jnp.int32)
    assert fits(2048, 768) and not fits(2048, 100) and not fits(100, 768)
    with pytest.raises(ValueError, match="multiples of 64"):
        ragged_matmul(jnp.zeros((128, 96), jnp.bfloat16), jnp.zeros((2, 128, 96), jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="does not contract"):
        ragged_matmul(jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((2, 128, 128), jnp.bfloat16), sizes)
    with pytest.raises(ValueError, match="3 group sizes"):
        ragged_matmul(jnp.zeros((128, 128), jnp.bfloat16), jnp.zeros((3, 128, 128), jnp.bfloat16), sizes)


@pytest.mark.parametrize("m, k, n, experts, tiles", [
    (2304, 2048, 768, 128, WgmmaTiles()),  # Qwen3-30B-A3B's gate/up
    (2304, 768, 2048, 128, WgmmaTiles(block_n=256)),  # and down
    (512, 4096, 14336, 8, WgmmaTiles(block_n=256, stages=3, grid_block_n=2)),  # Mixtral-8x7B's w1
])
def test_lowers_for_cuda(m, k, n, experts, tiles):
    """Mosaic GPU's lowering runs on this CPU (shared memory, TMA and wgmma layouts are checked there): forward and
    input gradient, each a Mosaic GPU kernel."""
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((experts, n, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32)

    def step(x, w, sizes):
        y, vjp = jax.vjp(lambda x: frozen_ragged_matmul(x, w, sizes, tiles), x)
        return y, vjp(y)[0]

    text = jax.jit(step).trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2, "forward and input-gradient kernels"


def _hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "0")).startswith("9")


@pytest.mark.gpu
@pytest.mark.parametrize("m, k, n, experts, used, tiles", [
    (1408, 256, 384, 16, 1300, WgmmaTiles()),
    (2304, 2048, 768, 128, 2200, WgmmaTiles(block_n=128, stages=4)),
    (1024, 768, 2048, 128, 1024, WgmmaTiles(block_m=64, block_n=256)),  # dx: N = 768, three column tiles
])
def test_kernel_on_hopper_equals_float64(m, k, n, experts, used, tiles):
    """Compiled on the GPU: uneven and empty groups, groups not in whole tiles, rows past the last group zero;
    the input gradient through the custom VJP, the frozen weight's cotangent zero."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs a Hopper GPU (compute capability 9.0)")
    sizes, x, w, dy = _case(m, m, k, n, experts, used)
    xb, wb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))
    x64, w64, dy64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (xb, wb, dyb))
    y, vjp = jax.vjp(lambda x, w: frozen_ragged_matmul(x, w, jnp.asarray(sizes), tiles), xb, wb)
    dx, dw = vjp(dyb)
    want, want_dx = _grouped64(x64, w64, sizes, False), _grouped64(dy64, w64, sizes, True)
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    np.testing.assert_allclose(np.asarray(dx.astype(jnp.float32)), want_dx, rtol=2e-2,
                               atol=2e-2 * np.abs(want_dx).max())
    assert not np.asarray(y[used:].astype(jnp.float32)).any() and not np.asarray(dw.astype(jnp.float32)).any()


@pytest.mark.gpu
def test_moe_grouped_matmul_through_wgmma_equals_the_triton_kernel(monkeypatch):
    """jaxtune.moe.grouped_matmul on a routed layout (Qwen3-30B-A3B's gate shape): the dispatch's wgmma path gives
    the Triton kernel's rows, padding rows and the unused tail included, and the same input gradient."""
    if not _hopper():
        pytest.skip("the wgmma kernel needs a Hopper GPU (compute capability 9.0)")
    from jaxtune.moe.grouped import grouped_matmul
    from jaxtune.moe.layout import tile_layout
    from jaxtune.ops import dispatch

    rng = np.random.default_rng(3)
    experts = np.stack([rng.choice(128, 8, replace=False) for _ in range(300)])
    layout = tile_layout(jnp.asarray(experts), 128)
    x = jnp.asarray(rng.standard_normal((layout.rows, 2048)), jnp.bfloat16)
    x = jnp.where(jnp.zeros((layout.rows,), bool).at[layout.position].set(True)[:, None], x, 0)  # padding rows zero
    w = jnp.asarray(rng.standard_normal((128, 768, 2048)) / 45, jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((layout.rows, 768)), jnp.bfloat16)
    results = {}
    for wgmma in (True, False):
        monkeypatch.setattr(dispatch, "MOE_WGMMA_ON_HOPPER", wgmma)
        assert dispatch.moe_frozen_impl() == ("wgmma" if wgmma else "pallas")
        y, vjp = jax.vjp(jax.jit(lambda x: grouped_matmul(x, w, layout)), x)
        results[wgmma] = [np.asarray(a.astype(jnp.float32)) for a in (y, vjp(dy)[0])]
    for got, want in zip(results[True], results[False]):
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
