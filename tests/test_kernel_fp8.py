"""FP8 compute: the quantizer against ml_dtypes' float8 rounding, the Pallas FP8 GEMM (interpret mode) and the
NF4 -> e4m3 weight kernel against float64 numpy, CUDA lowering, the FP8 projection's forward and input gradient
in every dispatch mode, and training with `compute="fp8"`."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas.triton import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL

import jaxtune
from jaxtune import ops
from jaxtune.quant import nf4
from jaxtune.ops import dispatch
from jaxtune.ops.fp8_linear import fp8_weight, fp8_weight_t
from jaxtune.training.config import ConfigError
from pallas_kernels.fp8_matmul import Fp8Tiles, fp8_matmul, fp8_matmul_reference
from pallas_kernels.fp8_quantize import pow2_scale, quantize_blocks, quantize_rows, quantize_rows_reference
from pallas_kernels.nf4_dequant import nf4_dequantize

NP_FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def numpy_pow2_scale(amax: np.ndarray, fmax: float) -> np.ndarray:
    """float64: the smallest power of two >= amax / fmax, at least 2^-126; 1 below 2^-126 (zero rows)."""
    amax = np.asarray(amax, np.float64)
    scale = np.maximum(2.0 ** np.ceil(np.log2(np.maximum(amax, 1e-300) / fmax)), 2.0**-126)
    return np.where(amax >= 2.0**-126, scale, 1.0)


def numpy_quantize(a: np.ndarray, block: int | None, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy: power-of-two scale per block >= amax / max finite, values rounded by ml_dtypes."""
    dtype, fmax = NP_FP8[fmt]
    k = a.shape[-1]
    block = block or k
    blocks = a.astype(np.float64).reshape(*a.shape[:-1], k // block, block)
    amax = np.abs(blocks).max(-1)
    scale = numpy_pow2_scale(amax, fmax)
    q = (blocks / scale[..., None]).astype(dtype)
    return q.reshape(a.shape), scale


def numpy_dequant(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    k = q.shape[-1]
    block = k // scale.shape[-1]
    return (q.astype(np.float64).reshape(*q.shape[:-1], -1, block) * scale[..., None]).reshape(q.shape)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [None, 64, 128])
def test_quantizer_rounds_like_ml_dtypes_with_power_of_two_scales(fmt, block):
    rng = np.random.default_rng(7)
    a = (rng.standard_normal((5, 384)) * np.exp(rng.uniform(-6, 6, (5, 1)))).astype(np.float32)
    a[2] = 0.0  # an all-zero row: scale 1, values 0
    a[3, :64] *= 1e3  # an outlier block
    q, scale = quantize_blocks(jnp.asarray(a), block, fmt)
    q_ref, scale_ref = numpy_quantize(a, block, fmt)
    np.testing.assert_array_equal(np.asarray(scale, np.float64), scale_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    mantissa = {"e4m3": 3, "e5m2": 2}[fmt]
    big = np.abs(a) > np.abs(a).max(-1, keepdims=True) * 2.0**-5  # well inside the normal range
    rel = np.abs(numpy_dequant(np.asarray(q), np.asarray(scale)) - a)[big] / np.abs(a)[big]
    assert rel.max() <= 2.0 ** -(mantissa + 1) * 1.0001


def test_power_of_two_scale_at_the_boundaries():
    """The exponent-bit rule against float64: exact multiples of max finite by powers of two keep that power,
    one float32 step above doubles it; tiny maxima stop at 2^-126, zero and float32 subnormals give 1."""
    for fmt in ("e4m3", "e5m2"):
        dtype, fmax = NP_FP8[fmt]
        exact = np.float32(fmax) * np.float32(2.0) ** np.arange(-60, 60, dtype=np.float32)
        amax = np.concatenate([exact, np.nextafter(exact, np.float32(np.inf)), np.nextafter(exact, np.float32(0)),
                               np.float32([0.0, 1e-40, 1e-36, 3.0e38])])
        want = numpy_pow2_scale(amax, fmax)
        got = np.asarray(pow2_scale(jnp.asarray(amax), {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[fmt]))
        np.testing.assert_array_equal(got.astype(np.float64), want)


def rows_to_quantize(m: int, k: int, seed: int) -> np.ndarray:
    """bf16-valued rows spanning 12 binades, with a zero row, a row scaled to 2^-126 and an outlier."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)) * np.exp(rng.uniform(-4, 4, (m, 1)))
    a[0] = 0.0
    if m > 2:
        a[1] = np.sign(a[1]) * rng.uniform(1, 2, k) * 2.0**-120  # amax below 448 * 2^-126: scale 2^-126
        a[2, k // 3] = 3e4
    return np.asarray(jnp.asarray(a, jnp.bfloat16))


@pytest.mark.parametrize("m, k", [(1, 64), (5, 192), (12, 576), (40, 1040), (16, 4096), (3, 14336)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_row_quantize_kernel_rounds_like_ml_dtypes(m, k, fmt):
    """The one-pass Pallas quantizer (interpret mode) against float64 numpy and ml_dtypes' rounding, bit for bit,
    on ragged row counts and widths that no power of two covers."""
    a = rows_to_quantize(m, k, seed=m * k)
    lead = (m,) if m % 2 else (2, m // 2)  # leading axes are kept
    x = jnp.asarray(a, jnp.bfloat16).reshape(*lead, k)
    q, scale = quantize_rows(x, fmt, interpret=True)
    assert q.shape == (*lead, k) and scale.shape == (*lead, 1)
    q_ref, scale_ref = numpy_quantize(a.astype(np.float64), None, fmt)
    np.testing.assert_array_equal(np.asarray(scale, np.float64).reshape(m, 1), scale_ref)
    np.testing.assert_array_equal(np.asarray(q).reshape(m, k).view(np.uint8), q_ref.view(np.uint8))
    q_jnp, scale_jnp = quantize_rows_reference(x, fmt)
    np.testing.assert_array_equal(np.asarray(q_jnp).view(np.uint8), np.asarray(q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale_jnp), np.asarray(scale))


def test_row_quantize_refusals():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_rows(jnp.ones((4, 72)), interpret=True)
    with pytest.raises(ValueError, match="FP8 format"):
        quantize_rows(jnp.ones((4, 64)), fmt="e3m4", interpret=True)


SHAPES = [(64, 128), (192, 576), (128, 1024)]


@pytest.mark.parametrize("m, shape_index, block", [(m, i, [None, 64][(j + i) % 2])  # every pair of settings once
                                                    for j, m in enumerate([1, 7, 130]) for i in range(len(SHAPES))])
def test_fp8_kernel_matches_float64(m, shape_index, block):
    n, k = SHAPES[shape_index]
    rng = np.random.default_rng(m + n + k)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    aq, sa = quantize_blocks(jnp.asarray(a), block)
    bq, sb = quantize_blocks(jnp.asarray(b), block)
    tiles = Fp8Tiles(block_m=64, block_n=64 if n % 128 else 128, block_k=64, num_warps=4, num_stages=2)
    y = fp8_matmul(aq, sa, bq, sb, tiles=tiles, out_dtype=jnp.float32, interpret=True)
    exact = numpy_dequant(np.asarray(aq), np.asarray(sa)) @ numpy_dequant(np.asarray(bq), np.asarray(sb)).T
    scale = np.abs(numpy_dequant(np.asarray(aq), np.asarray(sa))).max() * np.abs(np.asarray(b)).sum(1).max()
    np.testing.assert_allclose(np.asarray(y, np.float64), exact, atol=2e-6 * scale)
    ref = fp8_matmul_reference(aq, sa, bq, sb, jnp.float32)
    np.testing.assert_allclose(np.asarray(ref, np.float64), exact, atol=2e-6 * scale)
    # bf16 output: the product rounded once
    y16 = fp8_matmul(aq, sa, bq, sb, tiles=tiles, interpret=True)
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float64), exact, atol=2e-6 * scale, rtol=2**-8)


def test_fp8_kernel_leading_axes_and_refusals():
    a = jax.random.normal(jax.random.key(0), (2, 3, 128))
    aq, sa = quantize_blocks(a)
    bq, sb = quantize_blocks(jax.random.normal(jax.random.key(1), (64, 128)))
    assert fp8_matmul(aq, sa, bq, sb, interpret=True).shape == (2, 3, 64)
    with pytest.raises(ValueError, match="float8"):
        fp8_matmul(a, sa, bq, sb, interpret=True)
    with pytest.raises(ValueError, match="K=128"):
        fp8_matmul(aq[..., :64], sa, bq, sb, interpret=True)


def quantized(n, k, seed):
    rng = np.random.default_rng(seed)
    return nf4.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05)


def numpy_weight(q) -> np.ndarray:
    """float64 W [N, K] from the NF4 arrays (bnb's arithmetic: NF4[code] * absmax, per 64-block)."""
    codes = np.asarray(q.codes)
    idx = np.stack([codes >> 4, codes & 15], axis=-1).reshape(codes.shape[0], -1)
    absmax = np.asarray(nf4.dequantize_absmax(q), np.float64).reshape(codes.shape[0], -1)
    return nf4.NF4_CODE.astype(np.float64)[idx] * np.repeat(absmax, 64, axis=1)


def numpy_absmax(q) -> np.ndarray:
    return np.asarray(nf4.dequantize_absmax(q), np.float64).reshape(q.shape[0], -1)


def numpy_input_block_scale(q) -> np.ndarray:
    """float64 [in]: per 64-block of W's input columns, the power of two bringing the block's largest absmax down
    all rows to e4m3's range (the scale of Wᵀ's rows in the input gradient)."""
    return np.repeat(numpy_pow2_scale(numpy_absmax(q).max(0), 448.0), 64)


def test_nf4_to_e4m3_weight_kernel_is_one_rounding_of_the_bnb_value():
    """W for the forward (rows scaled by their largest absmax) and Wᵀ for the input gradient (input blocks
    scaled by theirs), kernel and reference: bitwise bnb's value / scale rounded once by ml_dtypes; Wᵀ's values
    times their scale equal W's times theirs wherever both are normal e4m3 numbers."""
    q = quantized(192, 576, seed=3)
    w = numpy_weight(q)
    row_scale = numpy_pow2_scale(numpy_absmax(q).max(1), 448.0)
    block_scale = numpy_input_block_scale(q)
    expect = (w.astype(np.float32) / row_scale[:, None]).astype(ml_dtypes.float8_e4m3fn)
    expect_t = (w.astype(np.float32) / block_scale[None, :]).astype(ml_dtypes.float8_e4m3fn).T
    for kernel in (True, False):
        wq, s = fp8_weight(q, kernel, interpret=True)
        np.testing.assert_array_equal(np.asarray(s, np.float64), row_scale)
        np.testing.assert_array_equal(np.asarray(wq).view(np.uint8), expect.view(np.uint8))
        wtq, t = fp8_weight_t(q, kernel, interpret=True)
        np.testing.assert_array_equal(np.asarray(t, np.float64), block_scale)
        np.testing.assert_array_equal(np.asarray(wtq).view(np.uint8), expect_t.view(np.uint8))
    tiny = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).smallest_normal)
    fwd, bwd = expect.astype(np.float64), expect_t.T.astype(np.float64)
    normal = (np.abs(fwd) >= tiny) & (np.abs(bwd) >= tiny)
    assert normal.mean() > 0.9
    np.testing.assert_array_equal((fwd * row_scale[:, None])[normal], (bwd * block_scale[None, :])[normal])


def fp8_projection(q, x: np.ndarray, dy: np.ndarray, mode: str, compute: str = "fp8") -> tuple[np.ndarray, np.ndarray]:
    """(y, dx) of the FP8 projection (jitted) in kernel mode `mode`, inputs in x's dtype."""
    dispatch.set_kernels(mode)
    try:
        def f(x):
            with ops.frozen_compute(compute):
                return ops.nf4_linear(x, q)

        y, vjp = jax.vjp(jax.jit(f), jnp.asarray(x))
        (dx,) = vjp(jnp.asarray(dy))
    finally:
        dispatch.set_kernels(None)
    return np.asarray(y, np.float64), np.asarray(dx, np.float64)


def numpy_fp8_projection(q, x: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy: y = quant(x) @ quant(W)ᵀ with power-of-two scales per row of x and of W; dx = quant(dy) @
    quant(W) with power-of-two scales per row of dy and per 64-block of W's input columns."""
    w = numpy_weight(q)
    w_scale = numpy_pow2_scale(numpy_absmax(q).max(1), 448.0)
    wq = (w.astype(np.float32) / w_scale[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    t_scale = numpy_input_block_scale(q)
    wtq = (w.astype(np.float32) / t_scale[None, :]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    xq, x_scale = numpy_quantize(np.asarray(x, np.float32), None, "e4m3")
    gq, g_scale = numpy_quantize(np.asarray(dy, np.float64), None, "e4m3")
    return (xq.astype(np.float64) @ wq.T) * x_scale * w_scale, (gq.astype(np.float64) @ wtq) * g_scale * t_scale


@pytest.mark.parametrize("mode", ["xla", "pallas-interpret"])
def test_fp8_projection_forward_and_input_gradient_match_float64(mode):
    """The FP8 projection equals its float64 numpy emulation, and is FP8-level close to the exact products."""
    q = quantized(192, 576, seed=5)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 5, 576)).astype(np.float32)
    dy = rng.standard_normal((2, 5, 192)).astype(np.float32)
    y, dx = fp8_projection(q, x, dy, mode)
    y_ref, dx_ref = numpy_fp8_projection(q, x, dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * np.abs(y_ref).max())
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5 * np.abs(dx_ref).max())
    w = numpy_weight(q)
    for got, exact in ((y, x.astype(np.float64) @ w.T), (dx, dy.astype(np.float64) @ w)):
        rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
        assert 1e-3 < rel < 0.08  # quantized to FP8 (not the bf16 path), and FP8-accurate


@pytest.mark.parametrize("mode", ["xla", "pallas-interpret"])
def test_fp8_input_gradient_only_keeps_the_forward_exact(mode):
    """"fp8-dx" (q and k under FP8): the forward is the float64 product of x and the bnb weight, not quantized;
    the input gradient is the FP8 projection's, equal to its float64 numpy emulation."""
    q = quantized(192, 576, seed=6)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((3, 7, 576)).astype(np.float32)
    dy = rng.standard_normal((3, 7, 192)).astype(np.float32)
    y, dx = fp8_projection(q, x, dy, mode, compute="fp8-dx")
    exact = x.astype(np.float64) @ numpy_weight(q).T
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    _, dx_ref = numpy_fp8_projection(q, x, dy)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5 * np.abs(dx_ref).max())


@pytest.mark.parametrize("m, n, k", [(8192, 4096, 14336), (300, 192, 576)])
def test_fp8_kernels_lower_for_cuda(cuda_export, m, n, k):
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    S = jax.ShapeDtypeStruct
    for block in (k, 64):
        text = cuda_export(lambda a, sa, b, sb: fp8_matmul(a, sa, b, sb),
                           S((m, k), f8), S((m, k // block), f32), S((n, k), f8), S((n, k // block), f32))
        assert text.count(f"@{CUSTOM_CALL}(") == 1
    for transpose in (False, True):
        text = cuda_export(lambda c, a: nf4_dequantize(c, a, f8, transpose=transpose),
                           S((n, k // 2), jnp.uint8), S((n, k // 64), f32))
        assert text.count(f"@{CUSTOM_CALL}(") == 1
    text = cuda_export(quantize_rows, S((m, k), jnp.bfloat16))
    assert text.count(f"@{CUSTOM_CALL}(") == 1


ROWS = [{"messages": [{"role": "user", "content": f"hello {i}"},
                      {"role": "assistant", "content": f"world {i % 5} fox"}]} for i in range(48)]


def test_training_in_fp8_follows_the_bf16_run(tiny_tokenizer):
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers

    shape = ModelConfig(model_type="llama", vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=tiny_tokenizer.eos_token_id)
    losses = {}
    for compute in ("bf16", "fp8"):
        model = quantize_layers(init_model(shape, dtype="float32", seed=0))
        cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=30, learning_rate=3e-3,
                                  schedule="constant", lora_r=8, compute=compute)
        losses[compute] = np.asarray(jaxtune.train(model, tiny_tokenizer, ROWS, cfg, progress=False).losses)
        assert model.compute == "bf16"  # the flag lives in the step's graph only
    assert not np.array_equal(losses["bf16"], losses["fp8"])  # the FP8 path ran
    assert np.mean(losses["fp8"][-5:]) < np.mean(losses["fp8"][:5]) - 0.5
    np.testing.assert_allclose(losses["fp8"], losses["bf16"], rtol=0.01)  # measured 0.12% at most


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch):
    class A100:
        device_kind, compute_capability = "NVIDIA A100-SXM4-80GB", "8.0"

    class H100:
        device_kind, compute_capability = "NVIDIA H100 80GB HBM3", "9.0"

    monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
    monkeypatch.setattr(jax, "local_devices", lambda: [A100()])
    with pytest.raises(jaxtune.JaxtuneError, match="compute capability 8.9"):
        dispatch.check_fp8_device()
    monkeypatch.setattr(jax, "local_devices", lambda: [H100()])
    dispatch.check_fp8_device()


def test_unknown_compute_mode_is_refused():
    with pytest.raises(ConfigError, match="compute"):
        jaxtune.TrainConfig(compute="fp16")
    with pytest.raises(ValueError, match="compute mode"):
        with ops.frozen_compute("int8"):
            pass


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "pallas"])
@pytest.mark.parametrize("compute", ["fp8", "fp8-dx"])
def test_fp8_on_gpu_matches_float64_of_the_quantized_operands(mode, compute):
    """On a GPU, through cuBLASLt (auto) or the Pallas kernels: the FP8 projection's forward and input gradient
    equal float64 products of the same e4m3 operands up to the bf16 output and FP8 accumulation ("fp8-dx": the
    forward is the bf16 product of x and the weight instead)."""
    q = quantized(1024, 4096, seed=2)
    rng = np.random.default_rng(3)
    x = np.asarray(jnp.asarray(rng.standard_normal((4, 512, 4096)), jnp.bfloat16))
    dy = np.asarray(jnp.asarray(rng.standard_normal((4, 512, 1024)), jnp.bfloat16))
    refs = numpy_fp8_projection(q, x, dy)
    if compute == "fp8-dx":
        refs = (x.astype(np.float64) @ numpy_weight(q).T, refs[1])
    for got, ref in zip(fp8_projection(q, x, dy, mode, compute), refs):
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m, k", [(2048, 14336), (300, 4096), (8, 1024)])
def test_row_quantizer_on_gpu_rounds_like_ml_dtypes(m, k):
    """The compiled kernel (not the interpreter) against float64 numpy and ml_dtypes, bit for bit."""
    a = rows_to_quantize(m, k, seed=k)
    q, scale = jax.jit(quantize_rows)(jnp.asarray(a, jnp.bfloat16))
    q_ref, scale_ref = numpy_quantize(a.astype(np.float64), None, "e4m3")
    np.testing.assert_array_equal(np.asarray(scale, np.float64), scale_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))


@pytest.mark.gpu
def test_projections_sharing_an_input_quantize_it_once():
    """gate and up read the same normed input: the compiled forward + backward of two FP8 projections on one x
    holds three quantizer calls (x once, each output gradient once), not four."""
    w1, w2 = quantized(1024, 4096, seed=4), quantized(1024, 4096, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 512, 4096)), jnp.bfloat16)

    def loss(x):
        with ops.frozen_compute("fp8"):
            return (ops.nf4_linear(x, w1).astype(jnp.float32) * ops.nf4_linear(x, w2)).sum()

    text = jax.jit(jax.value_and_grad(loss)).lower(x).compile().as_text()
    calls = [line for line in text.splitlines() if "custom-call(" in line and "fp8_quantize_rows" in line]
    assert len(calls) == 3, calls


def test_projections_sharing_an_input_quantize_it_once_in_the_trace():
    """Inside one FP8 block, projections of one input (gate and up; XLA was seen to keep both quantizer calls
    inside the layer scan) quantize it once: three quantizer calls in forward + backward, not four, and the
    same values and input gradient as each projection on its own."""
    w1, w2 = quantized(128, 192, seed=4), quantized(128, 192, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 8, 192)), jnp.float32)

    def shared_loss(x):
        with ops.frozen_compute("fp8"):
            return (ops.nf4_linear(x, w1) * ops.nf4_linear(x, w2)).sum()

    def separate_loss(x):
        with ops.frozen_compute("fp8"):
            y1 = ops.nf4_linear(x, w1)
        with ops.frozen_compute("fp8"):
            return (y1 * ops.nf4_linear(x, w2)).sum()

    dispatch.set_kernels("pallas-interpret")
    try:
        jaxpr = jax.make_jaxpr(jax.value_and_grad(shared_loss))(x)
        got = jax.value_and_grad(shared_loss)(x)
        want = jax.value_and_grad(separate_loss)(x)
    finally:
        dispatch.set_kernels(None)
    quantizers = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call" and "fp8_quantize_rows" in str(e.params)]
    assert len(quantizers) == 3
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
