"""How an NF4 weight reaches a Pallas kernel: its block scales in the kernels' layout, FP8's power-of-two
scales, and a layer of a stacked scan read in place (a slice handed to a custom call would be a copy)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxtune.ops import dispatch
from jaxtune.ops.sharded import per_batch_shard_with, replicated
from jaxtune.parallel.sharding import current_mesh, whole_on_every_device
from jaxtune.quant.nf4 import dequantize_absmax


class Fp8ScaleKind(NamedTuple):
    """FP8's power-of-two weight scales of one kind: the NF4Weight field of the prepared stack, the keyword the
    dequant kernel takes them by, and the axis of absmax [..., out, in / 64] whose maximum they bring to e4m3's
    range."""

    field: str
    keyword: str
    axis: int


# "rows": W's per output row, for the forward; "blocks": Wᵀ's per 64-block of input columns, for the input gradient
FP8_SCALES = {"rows": Fp8ScaleKind("fp8_scale", "row_scale", -1),
              "blocks": Fp8ScaleKind("fp8_block_scale", "block_scale", -2)}


def kernel_shaped(weight) -> bool:
    """One weight (its own codes, or one layer of a stack) whose out and in dims the kernels' tiles divide."""
    n, k = weight.shape
    one = jnp.asarray(weight.codes).ndim == (2 if weight.layer is None else 3)
    return one and n % 64 == 0 and k % 64 == 0


def kernel_absmax(weight) -> jax.Array:
    """The float32 scale of every 64-value block of this weight, [out, in / 64] (double quantization undone)."""
    n, k = weight.shape
    return dequantize_absmax(weight).reshape(n, k // 64)


def _pow2_scales(absmax: jax.Array, kind: str) -> jax.Array:
    """FP8's scales of `kind` from the block absmax [..., out, in / 64]: the largest |w| they cover (its largest
    absmax) brought to e4m3's range by a power of two."""
    from pallas_kernels.fp8_quantize import E4M3, pow2_scale

    return pow2_scale(jnp.max(absmax, axis=FP8_SCALES[kind].axis), E4M3)


def fp8_scales(weight, kind: str, absmax: jax.Array | None = None) -> jax.Array:
    """This weight's FP8 scales of `kind` ([out] or [in / 64]): its layer's prepared ones, else from its absmax."""
    prepared = getattr(weight, FP8_SCALES[kind].field)
    if prepared is not None:
        return prepared if weight.layer is None else jax.lax.dynamic_index_in_dim(prepared, weight.layer,
                                                                                   keepdims=False)
    return _pow2_scales(kernel_absmax(weight) if absmax is None else absmax, kind)


def prepare_kernel_scales(weight, fp8: bool) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """What the Pallas kernels read of a stack of NF4 weights, for all layers at once: the block scales
    [..., in / 64, out] (the kernels' layout) and, for FP8, each row's power-of-two scale [..., out] (W's, for
    the forward) and each input block's [..., in / 64] (Wᵀ's, for the input gradient). Inside the layer scan each
    is a small fusion (and a reduction) per projection, layer and pass, ~900 per 8B step."""
    n, k = weight.shape
    absmax = dequantize_absmax(weight).reshape(*jnp.shape(weight.codes)[:-2], n, k // 64)
    if not fp8:
        return jnp.swapaxes(absmax, -1, -2), None, None
    return jnp.swapaxes(absmax, -1, -2), _pow2_scales(absmax, "rows"), _pow2_scales(absmax, "blocks")


def kernels_read_prepared_scales() -> bool:
    """Whether NF4 projections traced now run Pallas kernels that read a stack in place (no mesh): the calls for
    which `prepare_kernel_scales` pays."""
    return current_mesh() is None and dispatch.nf4_impl(1) != "xla"


def layer_on_every_device(weight):
    """On a mesh, this weight's own codes and absmax codes (one layer of a stack) gathered whole on every device,
    1 byte each, so XLA dequantizes it and multiplies each device's rows locally, instead of splitting the
    matmul along the weight's FSDP split and moving activations between devices; as it is without a mesh."""
    if current_mesh() is None:
        return weight
    codes, absmax_codes = whole_on_every_device(weight.own_codes(), weight.absmax_codes)
    return dataclasses.replace(weight, codes=codes, absmax_codes=absmax_codes, layer=None, kernel_absmax=None,
                               fp8_scale=None, fp8_block_scale=None)


def with_codes(weight, kernel: Callable[..., jax.Array], *args: jax.Array, fp8_kind: str | None = None) -> jax.Array:
    """kernel(*args, codes, absmax[, layer=][, row_scale= | block_scale=]) for a Pallas kernel: a layer of a stack
    is read in place from the stack (unless the stack is past the kernels' 32-bit offsets: then the kernel slices
    the layer), with its prepared scales when the weight carries them; on a mesh the weight's own codes are
    gathered whole on every device and the kernel runs on each device's rows of `args`. `fp8_kind` ("rows" /
    "blocks"): the kernel also takes FP8's scales of that kind."""
    keyword = FP8_SCALES[fp8_kind].keyword if fp8_kind else None
    if weight.layer is not None and current_mesh() is None:
        absmax = weight.kernel_absmax if weight.kernel_absmax is not None else kernel_absmax(weight)
        scales = {}
        if keyword:  # the prepared stack as it is, else this layer's own
            prepared = getattr(weight, FP8_SCALES[fp8_kind].field)
            scales[keyword] = prepared if prepared is not None else fp8_scales(weight, fp8_kind)
        return kernel(*args, jnp.asarray(weight.codes), absmax, layer=weight.layer, **scales)
    gathered = layer_on_every_device(weight)  # 1-byte arrays gathered; the float32 scales made on every device
    absmax = kernel_absmax(gathered)
    whole = (gathered.codes, absmax)
    if keyword:
        whole, kernel = (*whole, fp8_scales(gathered, fp8_kind, absmax)), _scales_last(kernel, keyword)
    if args:  # each device's own rows (activations never move), the weight whole on every device
        return per_batch_shard_with(kernel, args, whole)
    return replicated(kernel, *whole)


def _scales_last(kernel: Callable[..., jax.Array], keyword: str) -> Callable[..., jax.Array]:
    """kernel taking its last positional operand by `keyword` (shard_map passes operands by position)."""
    return lambda *a: kernel(*a[:-1], **{keyword: a[-1]})


def dequantized(weight, dtype, interpret: bool, transpose: bool = False, fp8_kind: str | None = None,
                permute: bool = False) -> jax.Array:
    """W (or Wᵀ) in dtype by the Pallas dequant kernel (`fp8_kind`: divided by FP8's scales of that kind;
    `permute`: e4m3 W or Wᵀ by the kernel's byte-permute path)."""
    from pallas_kernels.nf4_dequant import nf4_dequantize

    def dequant(codes, absmax, **kw):
        return nf4_dequantize(codes, absmax, dtype, transpose=transpose, permute=permute, interpret=interpret, **kw)

    return with_codes(weight, dequant, fp8_kind=fp8_kind)
