"""The one dispatch point for the model's heavy ops (projections and attention).

Every matmul and attention call of the model goes through here, so faster backends (Pallas kernels)
plug in without touching the model. The functions below are the XLA reference; `jaxtune.dispatch`
(`JAXTUNE_KERNELS`) decides per call whether a Pallas kernel or cuDNN runs instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtune import dispatch
from jaxtune.sharding import BATCH_AXES, batch_shards, current_mesh

_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def dot_out(a: jax.Array, b: jax.Array, dims, out_dtype: jnp.dtype) -> jax.Array:
    """dot_general with f32 accumulation, written in `out_dtype`.

    On GPU a 16-bit result comes straight out of the GEMM (cuBLAS and XLA's GEMM fusions accumulate in f32
    and round once at the end): asking for an f32 result there makes XLA write the [tokens, out] product in
    f32 and convert it in a separate pass. Elsewhere the product is formed in f32 and rounded."""
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype.itemsize == 2 and jax.default_backend() == "gpu":
        return jax.lax.dot_general(a, b, dims, preferred_element_type=out_dtype)
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def linear(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """y = x @ weight.T (+ bias) for an HF-layout weight [out, in]; f32 accumulation, x's dtype out."""
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    if bias is None:
        return dot_out(x, weight.astype(x.dtype), dims, out_dtype or x.dtype)
    y = jax.lax.dot_general(x, weight.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return (y + bias.astype(jnp.float32)).astype(out_dtype or x.dtype)


def attention_mask(
    q_len: int,
    kv_len: int,
    *,
    q_offset: jax.Array | int = 0,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    sliding_window: int | None = None,
) -> jax.Array:
    """Boolean [B or 1, q_len, kv_len]: causal by index (query i sits at q_offset + i), same segment only."""
    q_idx = jnp.arange(q_len)[:, None] + q_offset
    kv_idx = jnp.arange(kv_len)[None, :]
    mask = (kv_idx <= q_idx)[None]
    if sliding_window is not None:
        mask = mask & ((q_idx - kv_idx) < sliding_window)[None]
    if q_segment_ids is not None:
        kv_seg = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        mask = mask & (q_segment_ids[:, :, None] == kv_seg[:, None, :])
    return mask


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_offset: jax.Array | int = 0,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal grouped-query attention, XLA reference.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D] with Hq a multiple of Hkv (kv heads are shared by index, never
    repeated in memory). Query i is at key index q_offset + i (q_offset > 0 when attending to a KV cache).
    Segment ids [B, T] / [B, S] restrict attention to tokens of the same packed sample (each id one
    contiguous run, as packing lays them out).
    """
    fast = _fast_attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, sliding_window)
    if fast is not None:
        return fast
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, t, hkv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    mask = attention_mask(
        t, s, q_offset=q_offset, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        sliding_window=sliding_window,
    )
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def _fast_attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, sliding_window) -> jax.Array | None:
    """Flash attention (Pallas) or cuDNN for the full-sequence case, per `dispatch`; None: use the reference."""
    full_sequence = isinstance(q_offset, int) and q_offset == 0 and kv_segment_ids is None and k.shape[1] == q.shape[1]
    if not full_sequence or q.shape[-1] not in (64, 128):
        return None
    plain = q_segment_ids is None and sliding_window is None and q.dtype in (jnp.bfloat16, jnp.float16)
    impl = dispatch.attention_impl(plain_causal=plain and q.shape[1] % 64 == 0)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if impl in ("pallas", "cudnn"):
        from pallas_kernels.flash_attention import flash_attention

        def flash(q, k, v, *seg):
            return flash_attention(q, k, v, *seg, sliding_window=sliding_window, interpret=dispatch.interpret())

        seg = () if q_segment_ids is None else (q_segment_ids,)
        return _per_batch_shard(flash, q, k, v, *seg)
    return None


def _per_batch_shard(fn, *args: jax.Array) -> jax.Array:
    """fn (a Pallas kernel, which XLA cannot partition) on each device's slice of the batch (dim 0) on a mesh."""
    return _per_batch_shard_with(fn, args, ())


def _per_batch_shard_with(fn, sharded: tuple[jax.Array, ...], replicated: tuple[jax.Array, ...]) -> jax.Array:
    """fn(*sharded, *replicated) per device on a mesh: `sharded` split on dim 0 over the batch axes (when it
    divides), `replicated` whole on every device (FSDP-sharded weights are all-gathered going in)."""
    mesh = current_mesh()
    if mesh is None:
        return fn(*sharded, *replicated)
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names)
    lead = axes if sharded[0].shape[0] % batch_shards(mesh) == 0 else None
    specs = tuple(P(lead) for _ in sharded) + tuple(P() for _ in replicated)
    return jax.shard_map(fn, in_specs=specs, out_specs=P(lead), check_vma=False)(*sharded, *replicated)


def _replicated(fn, *args: jax.Array) -> jax.Array:
    """fn on whole operands on every device of a mesh: FSDP-sharded weights are all-gathered going in."""
    if current_mesh() is None:
        return fn(*args)
    return jax.shard_map(fn, in_specs=tuple(P() for _ in args), out_specs=P(), check_vma=False)(*args)


def _zero_cotangent(a: jax.Array) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, dtype=jax.dtypes.float0)
    return jnp.zeros_like(a)


@jax.custom_vjp
def _nf4_matmul(x: jax.Array, weight) -> jax.Array:
    from jaxtune.nf4 import dequantize

    return linear(x, dequantize(weight, x.dtype))


def _nf4_matmul_fwd(x, weight):
    # keep only the 4-bit arrays for the backward pass, never the dequantized bf16 copy of W
    return _nf4_matmul(x, weight), weight


def _nf4_matmul_bwd(weight, dy):
    from jaxtune.nf4 import dequantize

    w = dequantize(weight, dy.dtype)  # [out, in]
    dx = dot_out(dy, w, (((dy.ndim - 1,), (0,)), ((), ())), dy.dtype)
    return dx, jax.tree.map(_zero_cotangent, weight)


_nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


# decoding's few rows on the CUDA cores: (block_n, block_bytes, split, num_warps) by rows and by the weight's N (at
# least), the fastest tile of each Llama-3-8B shape on the H200 (benchmarks/results/2026-11-24-decode-gemv-h200.md)
_GEMV_TILES = {
    1: ((8192, (32, 64, 4, 4)), (4096, (64, 64, 8, 4)), (0, (64, 64, 16, 4))),
    4: ((8192, (64, 32, 4, 4)), (4096, (32, 64, 4, 4)), (0, (16, 64, 16, 2))),
}


def _kernel_tiles(m: int, direction: str, shape: tuple[int, int] | None = None):
    """The fused kernels' tiles for M rows of a weight [N, K]: up to 4 rows forward (decoding) on the CUDA cores
    (1.1-1.7x the tensor-core tile there), by N; tensor-core tiles otherwise."""
    from pallas_kernels.nf4_matmul import MatmulTiles

    if m <= 4 and direction == "fwd":
        n, rows = (shape or (0, 0))[0], 1 if m == 1 else 4
        block_n, block_bytes, split, warps = next(t for at_least, t in _GEMV_TILES[rows] if n >= at_least)
        return MatmulTiles(rows, block_n, block_bytes, split, warps, 3, lut="gather", gemv=True)
    if m <= 16:
        return MatmulTiles(16, 64, 32, 8, 4, 3)
    if m <= 256:
        return MatmulTiles(64, 64, 64, 2, 4, 3)
    return MatmulTiles(256, 128, 64, 1, 8, 3) if direction == "fwd" else MatmulTiles(128, 128, 64, 1, 8, 3)


def _kernel_shaped(weight) -> bool:
    """One weight (its own codes, or one layer of a stack) whose out and in dims the kernels' tiles divide."""
    n, k = weight.shape
    one = jnp.asarray(weight.codes).ndim == (2 if weight.layer is None else 3)
    return one and n % 64 == 0 and k % 64 == 0


def _kernel_absmax(weight) -> jax.Array:
    """The float32 scale of every 64-value block of this weight, [out, in / 64] (double quantization undone)."""
    from jaxtune.nf4 import dequantize_absmax

    n, k = weight.shape
    return dequantize_absmax(weight).reshape(n, k // 64)


class _Fp8ScaleKind(NamedTuple):
    """FP8's power-of-two weight scales of one kind: the NF4Weight field of the prepared stack, the keyword the
    dequant kernel takes them by, and the axis of absmax [..., out, in / 64] whose maximum they bring to e4m3's
    range."""

    field: str
    keyword: str
    axis: int


# "rows": W's per output row, for the forward; "blocks": Wᵀ's per 64-block of input columns, for the input gradient
_FP8_SCALES = {"rows": _Fp8ScaleKind("fp8_scale", "row_scale", -1),
               "blocks": _Fp8ScaleKind("fp8_block_scale", "block_scale", -2)}


def _pow2_scales(absmax: jax.Array, kind: str) -> jax.Array:
    """FP8's scales of `kind` from the block absmax [..., out, in / 64]: the largest |w| they cover (its largest
    absmax) brought to e4m3's range by a power of two."""
    from pallas_kernels.fp8_quantize import E4M3, pow2_scale

    return pow2_scale(jnp.max(absmax, axis=_FP8_SCALES[kind].axis), E4M3)


def _fp8_scales(weight, kind: str, absmax: jax.Array | None = None) -> jax.Array:
    """This weight's FP8 scales of `kind` ([out] or [in / 64]): its layer's prepared ones, else from its absmax."""
    prepared = getattr(weight, _FP8_SCALES[kind].field)
    if prepared is not None:
        return prepared if weight.layer is None else jax.lax.dynamic_index_in_dim(prepared, weight.layer,
                                                                                   keepdims=False)
    return _pow2_scales(_kernel_absmax(weight) if absmax is None else absmax, kind)


def prepare_kernel_scales(weight, fp8: bool) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """What the Pallas kernels read of a stack of NF4 weights, for all layers at once: the block scales
    [..., in / 64, out] (the kernels' layout) and, for FP8, each row's power-of-two scale [..., out] (W's, for
    the forward) and each input block's [..., in / 64] (Wᵀ's, for the input gradient). Inside the layer scan each
    is a small fusion (and a reduction) per projection, layer and pass, ~900 per 8B step."""
    from jaxtune.nf4 import dequantize_absmax

    n, k = weight.shape
    absmax = dequantize_absmax(weight).reshape(*jnp.shape(weight.codes)[:-2], n, k // 64)
    if not fp8:
        return jnp.swapaxes(absmax, -1, -2), None, None
    return jnp.swapaxes(absmax, -1, -2), _pow2_scales(absmax, "rows"), _pow2_scales(absmax, "blocks")


def kernels_read_prepared_scales() -> bool:
    """Whether NF4 projections traced now run Pallas kernels that read a stack in place (no mesh): the calls for
    which `prepare_kernel_scales` pays."""
    return current_mesh() is None and dispatch.nf4_impl(1) != "xla"


def _with_codes(weight, kernel, *args: jax.Array, fp8_scales: str | None = None) -> jax.Array:
    """kernel(*args, codes, absmax[, layer=][, row_scale= | block_scale=]) for a Pallas kernel: a layer of a stack
    is read in place from the stack, with its prepared scales when the weight carries them (a slice handed to a
    custom call would be a copy of the layer's codes); on a mesh the weight's own codes are gathered whole on
    every device first. `fp8_scales` ("rows" / "blocks"): the kernel also takes FP8's scales of that kind."""
    keyword = _FP8_SCALES[fp8_scales].keyword if fp8_scales else None
    if weight.layer is not None and current_mesh() is None:
        absmax = weight.kernel_absmax if weight.kernel_absmax is not None else _kernel_absmax(weight)
        scales = {}
        if keyword:  # the prepared stack as it is, else this layer's own
            prepared = getattr(weight, _FP8_SCALES[fp8_scales].field)
            scales[keyword] = prepared if prepared is not None else _fp8_scales(weight, fp8_scales)
        return kernel(*args, jnp.asarray(weight.codes), absmax, layer=weight.layer, **scales)
    absmax = _kernel_absmax(weight)
    if not keyword:
        return _replicated(kernel, *args, weight.own_codes(), absmax)
    own = lambda *a: kernel(*a[:-1], **{keyword: a[-1]})  # noqa: E731
    return _replicated(own, *args, weight.own_codes(), absmax, _fp8_scales(weight, fp8_scales, absmax))


def _dequantized(weight, dtype, interpret: bool, transpose: bool = False, fp8_scales: str | None = None,
                 permute: bool = False):
    """W (or Wᵀ) in dtype by the Pallas dequant kernel (`fp8_scales`: divided by FP8's scales of that kind;
    `permute`: e4m3 W or Wᵀ by the kernel's byte-permute path)."""
    from pallas_kernels.nf4_matmul import nf4_dequantize

    def dequant(codes, absmax, **kw):
        return nf4_dequantize(codes, absmax, dtype, transpose=transpose, permute=permute, interpret=interpret, **kw)

    return _with_codes(weight, dequant, fp8_scales=fp8_scales)


def _rows(a: jax.Array) -> int:
    return int(np.prod(a.shape[:-1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _nf4_kernel_matmul(x, weight, impl: str, interpret: bool):
    from pallas_kernels import nf4_matmul as kernels

    if impl == "fused":
        tiles = _kernel_tiles(_rows(x), "fwd", weight.shape)
        return _with_codes(weight, functools.partial(kernels.nf4_matmul_forward, tiles=tiles, interpret=interpret), x)
    return linear(x, _dequantized(weight, x.dtype, interpret))


def _nf4_kernel_matmul_fwd(x, weight, impl, interpret):
    return _nf4_kernel_matmul(x, weight, impl, interpret), weight


def _nf4_kernel_matmul_bwd(impl, interpret, weight, dy):
    from pallas_kernels import nf4_matmul as kernels

    if impl == "fused":
        tiles = _kernel_tiles(_rows(dy), "dx")
        dx = _with_codes(weight, functools.partial(kernels.nf4_matmul_dx, tiles=tiles, interpret=interpret), dy)
    else:
        w = _dequantized(weight, dy.dtype, interpret)
        dx = dot_out(dy, w, (((dy.ndim - 1,), (0,)), ((), ())), dy.dtype)
    return dx.astype(dy.dtype), jax.tree.map(_zero_cotangent, weight)


_nf4_kernel_matmul.defvjp(_nf4_kernel_matmul_fwd, _nf4_kernel_matmul_bwd)


_stacked_layer: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("stacked_layer", default=None)


@contextlib.contextmanager
def stacked_layer(index: jax.Array):
    """Within the block (a layer scan's body), NF4 weights whose codes are the whole stack are layer `index`."""
    token = _stacked_layer.set(index)
    try:
        yield
    finally:
        _stacked_layer.reset(token)


def stacked_layer_index() -> jax.Array | None:
    return _stacked_layer.get()


COMPUTE_MODES = ("bf16", "fp8")
# and, inside the model only: "fp8-dx", the forward in the model's dtype and the input gradient in FP8
_INNER_MODES = ("fp8-dx",)
_frozen_compute: contextvars.ContextVar[str] = contextvars.ContextVar("frozen_compute", default="bf16")
# (input, its FP8 rows and scales) quantized within the current "fp8" block, so projections that read one input
# (gate and up, q/k/v) quantize it once
_fp8_inputs: contextvars.ContextVar[list | None] = contextvars.ContextVar("fp8_inputs", default=None)


@contextlib.contextmanager
def frozen_compute(mode: str):
    """Within the block, NF4 projections traced compute in `mode`: "bf16" (the model's dtype), "fp8", or
    "fp8-dx" (the forward in the model's dtype, the input gradient in FP8)."""
    if mode not in COMPUTE_MODES + _INNER_MODES:
        raise ValueError(f"unknown compute mode {mode!r}; use one of {', '.join(COMPUTE_MODES)}")
    token = _frozen_compute.set(mode)
    inputs = _fp8_inputs.set([]) if mode == "fp8" else None
    try:
        yield
    finally:
        _frozen_compute.reset(token)
        if inputs is not None:
            _fp8_inputs.reset(inputs)


def frozen_compute_mode() -> str:
    """The mode `frozen_compute` set for what is traced now ("bf16" outside any block)."""
    return _frozen_compute.get()


# output gradients in FP8: e4m3 (3 mantissa bits) measured more accurate than e5m2 (benchmarks/fp8_matmul.py);
# power-of-two scales per row give e4m3 the range gradients need
FP8_GRAD_FORMAT = "e4m3"


def _fp8_weight(weight, kernel: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(wq e4m3 [out, in], scale float32 [out]): W ≈ wq * scale per output row, the scale the power of two
    that brings the row's largest |w| (its largest NF4 absmax) to e4m3's range. One rounding of bnb's
    float32 value NF4[code] * absmax; on GPU by the Pallas NF4 dequant kernel writing e4m3 directly."""
    from jaxtune.nf4 import dequantize
    from pallas_kernels.fp8_quantize import E4M3

    scale = _fp8_scales(weight, "rows")
    if kernel:
        return _dequantized(weight, E4M3, interpret, fp8_scales="rows", permute=True), scale
    return (dequantize(weight, jnp.float32) / scale[:, None]).astype(E4M3), scale


def _fp8_weight_t(weight, kernel: bool, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """(wtq e4m3 [in, out], scale float32 [in]): Wᵀ ≈ wtq * scale per row of Wᵀ (K-major for the input
    gradient's GEMM, written so by the kernel), the scale constant over each 64-block of W's input columns: the
    power of two that brings the block's largest absmax down all rows to e4m3's range. The scale then multiplies
    the GEMM's output columns, so the output gradient is quantized as it is (no factor along the contraction).
    The values are those of the forward's `_fp8_weight` (powers of two commute with the rounding) wherever
    both land in e4m3's normal range, i.e. for rows whose absmax is within ~2^10 of the block's largest."""
    from jaxtune.nf4 import dequantize
    from pallas_kernels.fp8_quantize import E4M3

    blocks = _fp8_scales(weight, "blocks")
    scale = jnp.broadcast_to(blocks[:, None], (blocks.shape[0], 64)).reshape(-1)
    if kernel:
        return _dequantized(weight, E4M3, interpret, transpose=True, fp8_scales="blocks", permute=True), scale
    return (dequantize(weight, jnp.float32) / scale[None, :]).astype(E4M3).T, scale


def _fp8_gemm(aq, a_scale, bq, b_scale, out_dtype, impl: str, interpret: bool):
    """dequant(aq) [..., K] @ dequant(bq)ᵀ for K-major bq [out, K]; one scale per row of aq ([..., 1]) and
    per output column (b_scale [out])."""
    from pallas_kernels import fp8_matmul as fp8

    if impl == "pallas":
        gemm = lambda a, s, b, t: fp8.fp8_matmul(a, s, b, t[:, None], out_dtype=out_dtype, interpret=interpret)  # noqa: E731
        return _per_batch_shard_with(gemm, (aq, a_scale), (bq, b_scale))
    if impl == "cublas":  # cuBLASLt's FP8 GEMM; the power-of-two scales then multiply exactly (XLA fuses them)
        y = jax.lax.dot_general(aq, bq, (((aq.ndim - 1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
        return (y.astype(jnp.float32) * a_scale * b_scale).astype(out_dtype)
    return fp8.fp8_matmul_reference(aq, a_scale, bq, b_scale[:, None], out_dtype)


def _fp8_quantize_rows(a, fmt: str, impl: str, interpret: bool):
    """(aq, scale [..., 1]): a in FP8 with a power-of-two scale per row. Off the XLA reference path, one Pallas
    pass per tensor (pallas_kernels/fp8_quantize.py) instead of XLA's row reduction fused into a's producer plus a
    separate cast pass; the same bits either way."""
    from pallas_kernels import fp8_quantize

    if impl == "xla":
        return fp8_quantize.quantize_rows_reference(a, fmt)
    return _per_batch_shard(lambda a: fp8_quantize.quantize_rows(a, fmt=fmt, interpret=interpret), a)


def _fp8_input(x: jax.Array, impl: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """x's e4m3 rows and scales, quantized once per traced array in the current "fp8" block (gate and up share
    their input; XLA was seen to keep both quantizer kernels inside the layer scan)."""
    seen = _fp8_inputs.get()
    for a, quantized in seen or ():
        if a is x:
            return quantized
    quantized = _fp8_quantize_rows(jax.lax.stop_gradient(x), "e4m3", impl, interpret)
    if seen is not None:
        seen.append((x, quantized))
    return quantized


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fp8_nf4_matmul(x, xq, x_scale, weight, impl: str, interpret: bool):
    """y = x @ dequant(W)ᵀ from x's FP8 rows (xq, x_scale: `_fp8_input(x)`); x is there for its gradient."""
    wq, w_scale = _fp8_weight(weight, impl != "xla", interpret)
    return _fp8_gemm(xq, x_scale, wq, w_scale, x.dtype, impl, interpret)


def _fp8_nf4_matmul_fwd(x, xq, x_scale, weight, impl, interpret):
    # like the bf16 path: only the 4-bit arrays are kept; the FP8 weight is re-derived in the backward pass
    return _fp8_nf4_matmul(x, xq, x_scale, weight, impl, interpret), weight


def _fp8_input_gradient(weight, dy: jax.Array, impl: str, interpret: bool) -> jax.Array:
    """dx = dy @ W = (dy quantized per row) @ (Wᵀ quantized per input block)ᵀ: both scales sit outside the
    contraction, so they multiply dx's rows and columns after the GEMM."""
    wtq, wt_scale = _fp8_weight_t(weight, impl != "xla", interpret)
    gq, g_scale = _fp8_quantize_rows(dy, FP8_GRAD_FORMAT, impl, interpret)
    return _fp8_gemm(gq, g_scale, wtq, wt_scale, dy.dtype, impl, interpret)


def _fp8_nf4_matmul_bwd(impl, interpret, weight, dy):
    from pallas_kernels.fp8_quantize import E4M3

    dx = _fp8_input_gradient(weight, dy, impl, interpret)
    # xq and its scales come from x through stop_gradient: their cotangents are dropped
    rows = dy.shape[:-1]
    return (dx, jnp.zeros((*rows, dx.shape[-1]), E4M3), jnp.zeros((*rows, 1), jnp.float32),
            jax.tree.map(_zero_cotangent, weight))


_fp8_nf4_matmul.defvjp(_fp8_nf4_matmul_fwd, _fp8_nf4_matmul_bwd)


def _bf16_nf4_matmul(x: jax.Array, weight, impl: str, interpret: bool) -> jax.Array:
    """The projection in x's dtype: a Pallas path on GPU (per `dispatch`), else dequantize then dot."""
    if impl != "xla" and _kernel_shaped(weight):
        return _nf4_kernel_matmul(x, weight, impl, interpret)
    return _nf4_matmul(x, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fp8_dx_nf4_matmul(x, weight, impl: str, fp8: str, interpret: bool):
    """y = x @ dequant(W)ᵀ in x's dtype, its input gradient an FP8 GEMM (`fp8`: that GEMM's implementation)."""
    return _bf16_nf4_matmul(x, weight, impl, interpret)


def _fp8_dx_nf4_matmul_fwd(x, weight, impl, fp8, interpret):
    return _fp8_dx_nf4_matmul(x, weight, impl, fp8, interpret), weight


def _fp8_dx_nf4_matmul_bwd(impl, fp8, interpret, weight, dy):
    return _fp8_input_gradient(weight, dy, fp8, interpret), jax.tree.map(_zero_cotangent, weight)


_fp8_dx_nf4_matmul.defvjp(_fp8_dx_nf4_matmul_fwd, _fp8_dx_nf4_matmul_bwd)


def nf4_linear(x: jax.Array, weight, bias: jax.Array | None = None) -> jax.Array:
    """y = x @ dequant(W).T (+ bias) for a frozen NF4 weight [out, in].

    XLA reference: dequantize then dot. On GPU (per `dispatch`) the fused Pallas kernel or the Pallas
    dequant kernel + cuBLAS. Either way the VJP gives dx only (W is frozen) and saves just the 4-bit
    arrays for the backward pass, re-dequantizing there. Under `frozen_compute("fp8")` the forward and the
    input gradient are FP8 GEMMs (e4m3, power-of-two scales per token row and per weight row, or per input
    block of Wᵀ for the input gradient; see `_fp8_nf4_matmul`), through cuBLASLt or the Pallas kernel per
    `dispatch`; under `frozen_compute("fp8-dx")` only the input gradient is.
    """
    impl, mode, interpret = dispatch.nf4_impl(_rows(x)), _frozen_compute.get(), dispatch.interpret()
    fp8 = dispatch.fp8_impl() if mode != "bf16" and _kernel_shaped(weight) else None
    if fp8 and mode == "fp8":
        y = _fp8_nf4_matmul(x, *_fp8_input(x, fp8, interpret), weight, fp8, interpret)
    elif fp8:  # "fp8-dx"
        y = _fp8_dx_nf4_matmul(x, weight, impl, fp8, interpret)
    else:
        y = _bf16_nf4_matmul(x, weight, impl, interpret)
    return y if bias is None else (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)
