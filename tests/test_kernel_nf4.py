"""Fused NF4 matmul kernels: interpret mode vs float64 numpy, dequant kernel vs bitsandbytes' arithmetic,
CUDA lowering, and the kernel dispatch (`JAXTUNE_KERNELS`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas.triton import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL

from jaxtune.quant import nf4
from pallas_kernels.nf4_dequant import nf4_dequantize
from pallas_kernels.nf4_matmul import (
    MatmulTiles, nf4_matmul, nf4_matmul_dx, nf4_matmul_forward, nf4_matmul_reference,
)


def quantized(n, k, seed):
    rng = np.random.default_rng(seed)
    q = nf4.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
    absmax = np.asarray(nf4.dequantize_absmax(q)).reshape(n, k // 64)
    return q, jnp.asarray(q.codes), jnp.asarray(absmax)


def numpy_weight(codes, absmax):
    """float64 W from bnb bytes: high nibble = even column, value = NF4[code] * absmax per 64-block."""
    codes = np.asarray(codes)
    idx = np.stack([codes >> 4, codes & 15], axis=-1).reshape(codes.shape[0], -1)
    w = nf4.NF4_CODE.astype(np.float64)[idx]
    return w * np.repeat(np.asarray(absmax, np.float64), 64, axis=1)


SHAPES = [(64, 128), (128, 192), (192, 576), (256, 256)]
TILES = [MatmulTiles(16, 64, 32, 1), MatmulTiles(32, 64, 64, 2), MatmulTiles(64, 128, 32, 4, lut="gather")]


# each row count on two shapes, each shape under two row counts, every tile set among them (8 of the 16 pairs)
@pytest.mark.parametrize("m, shape_index", [(m, (i + step) % len(SHAPES)) for i, m in enumerate([1, 7, 64, 300])
                                            for step in (0, 2)])
def test_fused_forward_and_dx_match_float64(m, shape_index):
    n, k = SHAPES[shape_index]
    tiles = TILES[(m + shape_index) % len(TILES)]
    _, codes, absmax = quantized(n, k, seed=m + n)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    w = numpy_weight(codes, absmax)
    f = lambda x: nf4_matmul(x, codes, absmax, tiles=tiles, dx_tiles=tiles, interpret=True)  # noqa: E731
    y, vjp = jax.vjp(f, jnp.asarray(x))
    (dx,) = vjp(jnp.asarray(dy))
    scale_y = np.abs(x).max() * np.abs(w).sum(1).max()
    np.testing.assert_allclose(np.asarray(y, np.float64), x.astype(np.float64) @ w.T, atol=2e-6 * scale_y)
    scale_dx = np.abs(dy).max() * np.abs(w).sum(0).max()
    np.testing.assert_allclose(np.asarray(dx, np.float64), dy.astype(np.float64) @ w, atol=2e-6 * scale_dx)
    # the custom VJP agrees with differentiating the jnp reference
    (dx_ref,) = jax.vjp(lambda x: nf4_matmul_reference(x, codes, absmax), jnp.asarray(x))[1](jnp.asarray(dy))
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), atol=2e-6 * scale_dx)


@pytest.mark.parametrize("tiles", [MatmulTiles(16, 64, 64, 4), MatmulTiles(16, 128, 32, 4)])
def test_split_reductions_cover_all_of_k_and_n_when_tiles_shrink(tiles):
    """K/2 = 288 takes 32-byte steps where the tiles ask 64, N = 576 takes 64-row blocks where they ask 128:
    the split of the reduction counts the shrunk steps, so no remainder of K (forward) or N (dx) is skipped."""
    n, k = 576, 576
    _, codes, absmax = quantized(n, k, seed=5)
    rng = np.random.default_rng(5)
    x, dy = rng.standard_normal((3, k)).astype(np.float32), rng.standard_normal((3, n)).astype(np.float32)
    w = numpy_weight(codes, absmax)
    y = nf4_matmul_forward(jnp.asarray(x), codes, absmax, tiles=tiles, interpret=True)
    dx = nf4_matmul_dx(jnp.asarray(dy), codes, absmax, tiles=tiles, interpret=True)
    np.testing.assert_allclose(np.asarray(y, np.float64), x @ w.T, atol=2e-6 * np.abs(x).max() * np.abs(w).sum(1).max())
    np.testing.assert_allclose(np.asarray(dx, np.float64), dy @ w, atol=2e-6 * np.abs(dy).max() * np.abs(w).sum(0).max())


GEMV_TILES = [MatmulTiles(1, 32, 64, 4, 4, lut="gather", gemv=True), MatmulTiles(1, 64, 64, 16, 4, gemv=True),
              MatmulTiles(4, 32, 64, 2, 2, gemv=True), MatmulTiles(8, 128, 32, 1, 4, gemv=True)]


# the weight tile as the dot's left operand (decoding's 16-64 rows on tensor cores)
WEIGHT_FIRST_TILES = [MatmulTiles(16, 64, 32, 1, weight_first=True), MatmulTiles(16, 128, 64, 2, weight_first=True),
                      MatmulTiles(64, 64, 32, 4, lut="gather", weight_first=True),
                      MatmulTiles(32, 128, 64, 1, weight_first=True)]

# each tile's row block against a row count it splits over programs or pads (or, at 4 x 4, runs exactly)
FORWARD_ONLY_CASES = [(1, GEMV_TILES[0]), (3, GEMV_TILES[0]), (2, GEMV_TILES[1]), (4, GEMV_TILES[1]),
                      (3, GEMV_TILES[2]), (4, GEMV_TILES[2]), (1, GEMV_TILES[3]), (3, GEMV_TILES[3]),
                      (1, WEIGHT_FIRST_TILES[0]), (16, WEIGHT_FIRST_TILES[0]), (7, WEIGHT_FIRST_TILES[1]),
                      (64, WEIGHT_FIRST_TILES[2]), (50, WEIGHT_FIRST_TILES[3]), (100, WEIGHT_FIRST_TILES[3])]


# each case on two of the four test shapes, consecutive cases (a tile's two row counts) on the other two: the row
# handling under test depends on the rows and the tile, the shapes vary the N and K blocks
@pytest.mark.parametrize("m, tiles, first", [(m, tiles, i % 2) for i, (m, tiles) in enumerate(FORWARD_ONLY_CASES)])
def test_forward_only_tiles_match_float64(m, tiles, first):
    """The forward kernel's CUDA-core mode (few rows, no tensor-core dot) and its weight-first tensor-core mode on
    two test shapes each, rows padded to the row block or split over programs, and reading one layer of a stack in
    place."""
    rng = np.random.default_rng(m)
    for n, k in SHAPES[first::2]:
        _, codes, absmax = quantized(n, k, seed=n + k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = x.astype(np.float64) @ numpy_weight(codes, absmax).T
        y = nf4_matmul_forward(jnp.asarray(x), codes, absmax, tiles=tiles, interpret=True)
        atol = 2e-6 * np.abs(x).max() * np.abs(numpy_weight(codes, absmax)).sum(1).max()
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=atol)
    stack = jnp.stack([quantized(128, 192, seed=s)[1] for s in range(3)])
    _, _, absmax = quantized(128, 192, seed=8)
    x = jnp.asarray(rng.standard_normal((m, 192)), jnp.float32)
    for layer in range(3):
        want = np.asarray(x, np.float64) @ numpy_weight(stack[layer], absmax).T
        for scales in (absmax, jnp.stack([absmax.T] * 3)):  # the layer's own, or a prepared stack
            y = nf4_matmul_forward(x, stack, scales, tiles=tiles, layer=jnp.int32(layer), interpret=True)
            np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="gemv, weight_first and permute"):
        nf4_matmul_dx(jnp.zeros((m, 128)), stack[0], absmax, tiles=tiles, interpret=True)


def test_byte_permutes_decode_bnbs_bf16_weights_bit_for_bit():
    """The bf16 table of each (row, block) read by byte permutes (the PTX's steps, interpreted) gives every weight
    bitsandbytes' bf16 dequantization gives: NF4[c] * absmax in float32, rounded once."""
    from pallas_kernels.nf4_dequant import bf16_permute_table, bf16_planes_by_permute

    _, codes, absmax = quantized(64, 256, seed=11)
    want = np.asarray(nf4_dequantize(codes, absmax, jnp.bfloat16, interpret=True)).view(np.uint16)
    scale = jnp.repeat(absmax, 32, axis=1)  # a 64-block's scale for each of its 32 code bytes
    even, odd = bf16_planes_by_permute(codes.astype(jnp.uint32), bf16_permute_table(scale), interpret=True)
    got = np.stack([np.asarray(even), np.asarray(odd)], axis=-1).reshape(64, 256).view(np.uint16)
    np.testing.assert_array_equal(got, want)


PERMUTE_TILES = [MatmulTiles(16, 64, 32, 2, lut="permute", weight_first=True),
                 MatmulTiles(64, 64, 64, 1, lut="permute", weight_first=True), MatmulTiles(16, 64, 32, 4, lut="permute")]


@pytest.mark.parametrize("m, tiles, first", [(1, PERMUTE_TILES[0], 0), (16, PERMUTE_TILES[0], 1),
                                             (50, PERMUTE_TILES[1], 0), (7, PERMUTE_TILES[2], 1)])
def test_permute_forward_matches_float64_on_bnbs_bf16_weights(m, tiles, first):
    """The forward kernel decoding W by byte permutes (bf16 x) on two test shapes each, and one layer of a stack read in
    place, against float64 products of bitsandbytes' bf16 W (the kernel's weights are those, bit for bit)."""
    rng = np.random.default_rng(m)
    for n, k in SHAPES[first::2]:
        _, codes, absmax = quantized(n, k, seed=n + k)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = np.asarray(nf4_dequantize(codes, absmax, jnp.bfloat16, interpret=True), np.float64)
        want = np.asarray(x, np.float64) @ w.T
        y = nf4_matmul_forward(x, codes, absmax, tiles=tiles, interpret=True)
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=2**-8 * np.abs(want).max() + 1e-6)
    stack = jnp.stack([quantized(128, 192, seed=s)[1] for s in range(3)])
    _, _, absmax = quantized(128, 192, seed=8)
    x = jnp.asarray(rng.standard_normal((m, 192)), jnp.bfloat16)
    for layer in range(3):
        w = np.asarray(nf4_dequantize(stack[layer], absmax, jnp.bfloat16, interpret=True), np.float64)
        want = np.asarray(x, np.float64) @ w.T
        for scales in (absmax, jnp.stack([absmax.T] * 3)):
            y = nf4_matmul_forward(x, stack, scales, tiles=tiles, layer=jnp.int32(layer), interpret=True)
            np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=2**-8 * np.abs(want).max() + 1e-6)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        nf4_matmul_forward(x.astype(jnp.float32), stack[0], absmax, tiles=tiles, interpret=True)
    with pytest.raises(ValueError, match="forward kernel"):
        nf4_matmul_dx(jnp.zeros((m, 128), jnp.bfloat16), stack[0], absmax, tiles=tiles, interpret=True)


def test_bf16_inputs_and_leading_axes():
    _, codes, absmax = quantized(128, 256, seed=3)
    x = jax.random.normal(jax.random.key(0), (2, 5, 256), jnp.bfloat16)
    y = nf4_matmul_forward(x, codes, absmax, interpret=True)
    assert y.shape == (2, 5, 128) and y.dtype == jnp.bfloat16
    ref = np.asarray(x, np.float64) @ numpy_weight(codes, absmax).T
    assert np.abs(np.asarray(y, np.float64) - ref).max() < 1e-2 * np.abs(ref).max()
    dx = nf4_matmul_dx(y, codes, absmax, interpret=True)
    assert dx.shape == x.shape and dx.dtype == jnp.bfloat16


@pytest.mark.parametrize("lut", ["gather", "select"])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("columns_first", [False, True])
def test_dequant_kernel_is_bitwise_the_bnb_dequantization(lut, transpose, columns_first):
    """Either launch order, 64- and 128-row tiles, N not a multiple of 128 (tiles shrink) and K of 9 blocks."""
    q, codes, absmax = quantized(192, 576, seed=1)
    for dtype in (jnp.float32, jnp.bfloat16):
        want = np.asarray(nf4.dequantize(q, dtype))
        for block_n in (64, 128):
            got = nf4_dequantize(codes, absmax, dtype, lut=lut, transpose=transpose, block_n=block_n,
                                 columns_first=columns_first, interpret=True)
            np.testing.assert_array_equal(np.asarray(got), want.T if transpose else want)


def stacked_weights(n, k, layers=3):
    """A stack of `layers` NF4 weights: codes [layers, N, K/2], each layer's absmax [N, K/64], and the scales
    prepared in the kernels' layout [layers, K/64, N]."""
    parts = [quantized(n, k, seed=s) for s in range(layers)]
    absmax = [p[2] for p in parts]
    return jnp.stack([p[1] for p in parts]), absmax, jnp.stack([a.T for a in absmax])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
@pytest.mark.parametrize("transpose", [False, True])
def test_dequant_kernel_reads_one_layer_of_a_stack(dtype, transpose):
    """With a layer index the kernel reads that layer of a stack of codes in place, with the layer's own absmax
    or a prepared stack of scales: bitwise the result of the layer's own arrays, for every layer of a stack whose
    layer count is no power of two."""
    stack, absmax, prepared = stacked_weights(192, 576)
    kernel = jax.jit(lambda c, a, i: nf4_dequantize(c, a, dtype, transpose=transpose, layer=i, interpret=True))
    for layer in range(3):
        want = nf4_dequantize(stack[layer], absmax[layer], dtype, transpose=transpose, interpret=True)
        for scales in (absmax[layer], prepared):
            got = kernel(stack, scales, jnp.int32(layer))
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    with pytest.raises(ValueError, match="stacked"):
        nf4_dequantize(stack[0], absmax[0], layer=jnp.int32(0), interpret=True)
    with pytest.raises(ValueError, match="stacked absmax"):
        nf4_dequantize(stack, prepared[:, :, :64], layer=jnp.int32(0), interpret=True)


# every launch layout (transpose x columns_first x permute, on which the index arithmetic depends) once; each shape
# and each scaling meets each value of every flag (two shapes: one 64-block per tile, K/2 = 288, and two, K/2 = 512)
FP8_SCALE_CASES = [(128, 576, "rows", False, False, False), (128, 576, "rows", False, False, True),
                   (64, 1024, "blocks", False, True, False), (64, 1024, "blocks", False, True, True),
                   (64, 1024, "rows", True, False, False), (128, 576, "blocks", True, False, True),
                   (64, 1024, "rows", True, True, False), (128, 576, "blocks", True, True, True)]


@pytest.mark.parametrize("n, k, scaled, transpose, columns_first, permute", FP8_SCALE_CASES)
def test_dequant_kernel_divides_by_fp8_scales(n, k, scaled, transpose, columns_first, permute):
    """`row_scale` (per row) or `block_scale` (per 64-block of W's columns), each also as a stack per layer, divide
    W as bnb's float32 NF4[code] * absmax / scale rounded once to e4m3: bitwise numpy's float64 value rounded by
    ml_dtypes (powers of two divide exactly), through the per-value path and through byte tables and permutes
    (`permute`, what FP8 runs), with one 64-block per tile (K/2 = 288) and two (K/2 = 512), 9 and 16 blocks."""
    stack, absmax, prepared = stacked_weights(n, k)
    e4m3 = jnp.float8_e4m3fn
    size, key = (n, "row_scale") if scaled == "rows" else (k // 64, "block_scale")
    scales = jnp.asarray(2.0 ** -np.random.default_rng(n + k).integers(-12, 4, (3, size)), jnp.float32)
    kw = dict(transpose=transpose, columns_first=columns_first, permute=permute, interpret=True)
    for layer in range(3):
        divisor = np.asarray(scales[layer], np.float64)
        w = numpy_weight(stack[layer], absmax[layer])
        w = w / divisor[:, None] if scaled == "rows" else w / np.repeat(divisor, 64)[None, :]
        want = (w.T if transpose else w).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        own = nf4_dequantize(stack[layer], absmax[layer], e4m3, **{key: scales[layer]}, **kw)
        in_place = nf4_dequantize(stack, prepared, e4m3, layer=jnp.int32(layer), **{key: scales}, **kw)
        np.testing.assert_array_equal(np.asarray(own).view(np.uint8), want)
        np.testing.assert_array_equal(np.asarray(in_place).view(np.uint8), want)
    with pytest.raises(ValueError, match=key):  # a stack of scales without a layer
        nf4_dequantize(stack[0], absmax[0], e4m3, **{key: scales}, **kw)


def test_byte_permutes_write_e4m3_only():
    stack, absmax, _ = stacked_weights(64, 128, layers=1)
    with pytest.raises(ValueError, match="permute"):
        nf4_dequantize(stack[0], absmax[0], jnp.bfloat16, permute=True, interpret=True)


@pytest.mark.parametrize("m", [1, 7, 64])
def test_fused_kernels_read_one_layer_of_a_stack(m):
    """The fused forward and dx kernels with a layer index (own absmax or the prepared stack of scales): bitwise
    the results from that layer's own arrays."""
    stack, absmax, prepared = stacked_weights(128, 192)
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 192)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((m, 128)), jnp.float32)
    for layer in range(3):
        y_want = nf4_matmul_forward(x, stack[layer], absmax[layer], tiles=TILES[0], interpret=True)
        dx_want = nf4_matmul_dx(dy, stack[layer], absmax[layer], tiles=TILES[0], interpret=True)
        for scales in (absmax[layer], prepared):
            y = nf4_matmul_forward(x, stack, scales, tiles=TILES[0], layer=jnp.int32(layer), interpret=True)
            dx = nf4_matmul_dx(dy, stack, scales, tiles=TILES[0], layer=jnp.int32(layer), interpret=True)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(y_want))
            np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_want))


def test_kernels_reject_bad_shapes():
    _, codes, absmax = quantized(64, 128, seed=0)
    with pytest.raises(ValueError, match="K=100"):
        nf4_matmul_forward(jnp.zeros((2, 100)), codes, absmax, interpret=True)
    with pytest.raises(ValueError, match="multiples of 64"):
        nf4_matmul_forward(jnp.zeros((2, 96)), jnp.zeros((64, 48), jnp.uint8), jnp.zeros((64, 1)), interpret=True)
    with pytest.raises(ValueError, match="uint8"):
        nf4_dequantize(codes.astype(jnp.int32), absmax, interpret=True)
    with pytest.raises(ValueError, match="absmax"):
        nf4_dequantize(codes, absmax[:, :1], interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("n, k", [(14336, 4096), (4096, 14336), (1024, 4096)])
def test_decoding_tiles_on_gpu_match_float64(m, n, k):
    """Compiled (not interpreted): the few-row tiles the dispatch takes for decoding on the 8B shapes, in float32,
    against float64 numpy."""
    from jaxtune.ops.nf4_linear import kernel_tiles

    tiles = kernel_tiles(m, "fwd", (n, k))
    assert tiles.gemv
    _compiled_forward_matches_float64(m, n, k, tiles)


def _compiled_forward_matches_float64(m: int, n: int, k: int, tiles: MatmulTiles) -> None:
    _, codes, absmax = quantized(n, k, seed=n + m)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    y = jax.jit(lambda x, c, a: nf4_matmul_forward(x, c, a, tiles=tiles))(jnp.asarray(x), codes, absmax)
    w = numpy_weight(codes, absmax)
    np.testing.assert_allclose(np.asarray(y, np.float64), x.astype(np.float64) @ w.T,
                               atol=2e-6 * np.abs(x).max() * np.abs(w).sum(1).max())


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", WEIGHT_FIRST_TILES)
@pytest.mark.parametrize("m", [5, 16, 64])
def test_weight_first_tiles_on_gpu_match_float64(m, tiles):
    """Compiled: the weight-first tensor-core tiles on the 8B shapes in float32 against float64 numpy (the
    interpreter cannot see how Triton lays out a register operand)."""
    for n, k in [(14336, 4096), (4096, 14336), (1024, 4096)]:
        _compiled_forward_matches_float64(m, n, k, tiles)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", PERMUTE_TILES)
@pytest.mark.parametrize("m", [5, 16, 64])
def test_permute_tiles_on_gpu_match_float64(m, tiles):
    """Compiled: W decoded by the inline PTX's byte permutes, on the 8B shapes in bf16, against float64 products of
    bitsandbytes' bf16 W."""
    for n, k in [(14336, 4096), (4096, 14336), (1024, 4096)]:
        _, codes, absmax = quantized(n, k, seed=n + m)
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.bfloat16)
        y = jax.jit(lambda x, c, a: nf4_matmul_forward(x, c, a, tiles=tiles))(x, codes, absmax)
        w = np.asarray(nf4_dequantize(codes, absmax, jnp.bfloat16), np.float64)
        want = np.asarray(x, np.float64) @ w.T
        np.testing.assert_allclose(np.asarray(y, np.float64), want, atol=2**-8 * np.abs(want).max())


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 1024, 4096), (300, 14336, 4096), (2048, 4096, 14336),
                                   (7, 576, 1536)])
def test_kernels_lower_for_cuda(cuda_export, m, n, k):
    from jaxtune.ops.nf4_linear import GEMV_TILES as DISPATCH_GEMV_TILES, kernel_tiles

    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    codes = jax.ShapeDtypeStruct((n, k // 2), jnp.uint8)
    absmax = jax.ShapeDtypeStruct((n, k // 64), jnp.float32)

    def grad(x, codes, absmax):
        f = lambda x: nf4_matmul(x, codes, absmax, tiles=kernel_tiles(m, "fwd", (n, k)),  # noqa: E731
                                 dx_tiles=kernel_tiles(m, "dx"))
        y, vjp = jax.vjp(f, x)
        return y, vjp(y)[0]

    assert cuda_export(grad, x, codes, absmax).count(f"@{CUSTOM_CALL}(") == 2
    if m <= 16:  # every few-row tile the dispatch table holds, and the tests' own
        table = [kernel_tiles(rows, "fwd", (at_least or n, k)) for rows in (1, 4) for at_least, _ in DISPATCH_GEMV_TILES[rows]]
        for tiles in GEMV_TILES + WEIGHT_FIRST_TILES + table:
            assert cuda_export(lambda x, c, a: nf4_matmul_forward(x, c, a, tiles=tiles), x, codes, absmax).count(
                f"@{CUSTOM_CALL}(") == 1
        for tiles in PERMUTE_TILES:  # byte permutes in inline PTX
            text = cuda_export(lambda x, c, a: nf4_matmul_forward(x, c, a, tiles=tiles), x, codes, absmax)
            assert text.count(f"@{CUSTOM_CALL}(") == 1 and "prmt.b32" in text
    for lut in ("gather", "select"):
        for columns_first in (False, True):
            text = cuda_export(lambda c, a: nf4_dequantize(c, a, lut=lut, columns_first=columns_first), codes, absmax)
            assert text.count(f"@{CUSTOM_CALL}(") == 1
    stack, layer = jax.ShapeDtypeStruct((32, n, k // 2), jnp.uint8), jax.ShapeDtypeStruct((), jnp.int32)
    prepared, rows = jax.ShapeDtypeStruct((32, k // 64, n), jnp.float32), jax.ShapeDtypeStruct((32, n), jnp.float32)
    for dtype, transpose in ((jnp.bfloat16, False), (jnp.float8_e4m3fn, True)):
        for scales in (absmax, prepared):
            text = cuda_export(lambda c, a, i: nf4_dequantize(c, a, dtype, transpose=transpose, layer=i),
                               stack, scales, layer)
            assert text.count(f"@{CUSTOM_CALL}(") == 1
    blocks = jax.ShapeDtypeStruct((32, k // 64), jnp.float32)
    # FP8's operands: W divided by its row scales (forward), Wᵀ by its input blocks' scales (input gradient), by
    # the per-value path and by byte permutes (inline PTX)
    for transpose, key, scales in ((False, "row_scale", rows), (True, "block_scale", blocks)):
        for permute in (False, True):
            text = cuda_export(lambda c, a, i, s: nf4_dequantize(c, a, jnp.float8_e4m3fn, transpose=transpose, layer=i,
                                                                 permute=permute, **{key: s}),
                               stack, prepared, layer, scales)
            assert text.count(f"@{CUSTOM_CALL}(") == 1 and ("prmt.b32" in text) == permute
    dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    for scales in (absmax, prepared):
        text = cuda_export(lambda x, d, c, a, i: (nf4_matmul_forward(x, c, a, tiles=kernel_tiles(m, "fwd"), layer=i),
                                                  nf4_matmul_dx(d, c, a, tiles=kernel_tiles(m, "dx"), layer=i)),
                           x, dy, stack, scales, layer)
        assert text.count(f"@{CUSTOM_CALL}(") == 2
