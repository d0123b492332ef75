"""The frozen 4-bit weights' types: the NF4 projection and the variables its codes, kernel scales and dequantized
copies live in. Below both the decoder and the mixture-of-experts blocks (which hold them), above nothing but ops."""

from __future__ import annotations

import jax
from flax import nnx

from jaxtune import ops
from jaxtune.quant import nf4


class QuantizedWeight(nnx.Variable):
    """A frozen array of a 4-bit weight (codes or scales): never trained, never differentiated."""


class KernelScales(nnx.Variable):
    """Scales derived from a frozen 4-bit weight for the kernels, within one traced call (never saved)."""


class DenseWeights(nnx.Variable):
    """Dequantized copies of a frozen 4-bit weight, one array per layer, within one traced sampler (never saved)."""


class NF4Linear(nnx.Module):
    """Frozen 4-bit projection y = x @ dequant(W).T (+ bias); arrays may carry a leading layer axis."""

    def __init__(self, q: nf4.NF4Weight, bias: jax.Array | None = None):
        self.codes = QuantizedWeight(q.codes)
        self.absmax_codes = QuantizedWeight(q.absmax_codes)
        self.nested_absmax = QuantizedWeight(q.nested_absmax)
        self.offset = QuantizedWeight(q.offset)
        self.nested_map = QuantizedWeight(q.nested_map)
        self.bias = None if bias is None else nnx.Param(bias)
        self.kernel_absmax: KernelScales | None = nnx.data(None)
        self.fp8_scale: KernelScales | None = nnx.data(None)
        self.fp8_block_scale: KernelScales | None = nnx.data(None)
        self.dense: DenseWeights | None = nnx.data(None)

    def prepare_dense(self, dtype, layers: int | None = None) -> None:
        """Dequantizes the weight of the first `layers` layers (None: all) once, a separate array per layer, for a
        sampler that reads it token after token: one traced layer per decoder layer then reads its own array (a
        layer sliced from a stack would be copied before every product); later layers keep the codes. Call it on a
        copy of the model made inside the traced function."""
        stacks = (self.codes[...], self.absmax_codes[...], self.nested_absmax[...], self.offset[...],
                  self.nested_map[...])  # the decoder layers' [layers, ...]
        count = stacks[0].shape[0] if layers is None else min(layers, stacks[0].shape[0])
        self.dense = DenseWeights(tuple(ops.dense_nf4_weight(nf4.NF4Weight(*(a[i] for a in stacks)), dtype)
                                        for i in range(count)))

    def prepare_kernel_scales(self, fp8: bool) -> None:
        """Computes the kernels' scales of every layer at once (`ops.prepare_kernel_scales`); call it on a copy
        of the model made inside the traced function, never on the caller's model."""
        absmax, row_scale, block_scale = ops.prepare_kernel_scales(self._arrays(), fp8)
        self.kernel_absmax = KernelScales(absmax)
        self.fp8_scale = None if row_scale is None else KernelScales(row_scale)
        self.fp8_block_scale = None if block_scale is None else KernelScales(block_scale)

    def _arrays(self, layer: jax.Array | None = None) -> nf4.NF4Weight:
        prepared = lambda v: None if v is None else v[...]  # noqa: E731
        return nf4.NF4Weight(self.codes[...], self.absmax_codes[...], self.nested_absmax[...], self.offset[...],
                             self.nested_map[...], layer, prepared(self.kernel_absmax), prepared(self.fp8_scale),
                             prepared(self.fp8_block_scale))

    @property
    def weight_nf4(self) -> nf4.NF4Weight:
        # inside the layer scan the codes (and the prepared kernel scales) stay the whole stack (the scan slices
        # every other array): this layer's index then comes from the scan body (`ops.stacked_layer`)
        stacked = self.codes[...].ndim == self.absmax_codes[...].ndim + 2
        layer = ops.stacked_layer_index() if stacked else None
        if stacked and layer is None:
            raise ValueError("NF4 codes stacked over layers need the layer index (ops.stacked_layer)")
        return self._arrays(layer)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        layer = ops.static_layer_index()
        if self.dense is not None and layer is not None and layer < len(self.dense.get_value()):
            return ops.linear(x, self.dense.get_value()[layer], bias)  # prepared for a sampler: this layer's own
        return ops.nf4_linear(x, self.weight_nf4, bias)
