"""The experts' projections as stacks [E, out, in] (HF's per-expert layout), each run as one grouped GEMM:
dense (`ExpertLinear`), frozen NF4 (`NF4Experts`, each expert quantized on its own as bitsandbytes quantizes an
expert's Linear) and with a LoRA adapter per expert (`LoRAExperts`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune import ops

from jaxtune.quant import nf4
from jaxtune.moe.expert_mlp import ExpertProjection, add_expert_bias
from jaxtune.moe.grouped import grouped_matmul
from jaxtune.moe.layout import TileLayout
from jaxtune.ops import dispatch
from jaxtune.parallel.sharding import current_mesh
from jaxtune.quant.weights import QuantizedWeight

_INIT_STD = 0.02


def _array(param: nnx.Param | None) -> jax.Array | None:
    return None if param is None else param[...]


class ExpertLinear(nnx.Module):
    """E dense projections, weight [E, out, in] (and a bias [E, out] with `bias`); rows in a `TileLayout`'s order
    in, the same rows out."""

    def __init__(self, experts: int, in_features: int, out_features: int, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 bias: bool = False):
        self.weight = nnx.Param(_INIT_STD * jax.random.normal(rngs.params(), (experts, out_features, in_features),
                                                              dtype))
        self.bias = nnx.Param(jnp.zeros((experts, out_features), dtype)) if bias else None

    def __call__(self, x: jax.Array, layout: TileLayout, rng: jax.Array | None = None) -> jax.Array:
        return add_expert_bias(grouped_matmul(x, self.weight[...], layout), _array(self.bias), layout)


class NF4Experts(nnx.Module):
    """E frozen NF4 projections (arrays [..., E, ...], a leading layer axis when stacked), dequantized at use to
    x's dtype and run as one grouped GEMM."""

    def __init__(self, q: nf4.NF4Weight, bias: jax.Array | None = None):
        self.codes = QuantizedWeight(q.codes)
        self.absmax_codes = QuantizedWeight(q.absmax_codes)
        self.nested_absmax = QuantizedWeight(q.nested_absmax)
        self.offset = QuantizedWeight(q.offset)
        self.nested_map = QuantizedWeight(q.nested_map)
        self.bias = None if bias is None else nnx.Param(bias)

    @property
    def weight_nf4(self) -> nf4.NF4Weight:
        # in the layer scan the codes stay the whole stack [layers, E, ...] (as the dense projections' do)
        stacked = self.codes[...].ndim == self.absmax_codes[...].ndim + 2
        layer = ops.stacked_layer_index() if stacked else None
        if stacked and layer is None:
            raise ValueError("NF4 expert codes stacked over layers need the layer index (ops.stacked_layer)")
        return nf4.NF4Weight(self.codes[...], self.absmax_codes[...], self.nested_absmax[...], self.offset[...],
                             self.nested_map[...], layer)

    def __call__(self, x: jax.Array, layout: TileLayout, rng: jax.Array | None = None) -> jax.Array:
        return add_expert_bias(grouped_matmul(x, self.dequantized(x.dtype), layout), _array(self.bias), layout)

    def dequantized(self, dtype: jnp.dtype) -> jax.Array:
        """The experts' weights [E, out, in] in dtype. Where the grouped kernel runs (one device), the Pallas NF4
        dequant kernel reads the codes in place, all experts as one [E * out, in] weight: one pass at memory
        speed, where XLA's table lookups over every expert took a fifth of a Qwen3-30B-A3B step
        (benchmarks/results/2026-11-28-moe-vs-unsloth-h200.md)."""
        q = self.weight_nf4
        codes = jnp.asarray(q.codes)
        experts, out, half = codes.shape[-3:]
        if (dispatch.moe_impl() != "pallas" or current_mesh() is not None
                or (experts * out) % nf4.BLOCK or (2 * half) % nf4.BLOCK):
            return nf4.dequantize(q, dtype)
        from pallas_kernels.nf4_dequant import nf4_dequantize

        absmax = nf4.dequantize_absmax(q).reshape(experts * out, 2 * half // nf4.BLOCK)
        rows = codes.reshape(*codes.shape[:-3], experts * out, half)  # a view: the stack stays whole in the scan
        w = nf4_dequantize(rows, absmax, dtype, layer=q.layer, interpret=dispatch.interpret())
        return w.reshape(experts, out, 2 * half)


class LoRAExperts(nnx.Module):
    """base(x) + scale * (x @ A[e].T) @ B[e].T for each row's expert e: A [E, r, in] (kaiming-uniform, as PEFT),
    B [E, out, r] (zeros), float32; both factors run as grouped GEMMs too."""

    def __init__(self, base: nnx.Module, experts: int, in_features: int, out_features: int, *, r: int,
                 alpha: float, use_rslora: bool, key: jax.Array, leading: tuple[int, ...] = (),
                 dropout: float = 0.0, dtype=jnp.float32):
        self.base = base
        bound = 1.0 / math.sqrt(in_features)
        self.lora_a = nnx.LoRAParam(jax.random.uniform(key, (*leading, experts, r, in_features), dtype, -bound, bound))
        self.lora_b = nnx.LoRAParam(jnp.zeros((*leading, experts, out_features, r), dtype))
        self.r, self.alpha, self.use_rslora = r, float(alpha), use_rslora
        self.scale = float(alpha) / (math.sqrt(r) if use_rslora else r)
        self.dropout = float(dropout)

    def __call__(self, x: jax.Array, layout: TileLayout, rng: jax.Array | None = None) -> jax.Array:
        """Dropout on the adapter's input only when the caller passes an rng (training), as `LoRALinear`."""
        y = self.base(x, layout)
        if rng is not None and self.dropout > 0.0:
            keep = jax.random.bernoulli(rng, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        a, b = self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype)
        hidden = grouped_matmul(x, a, layout, trainable=True) * jnp.asarray(self.scale, x.dtype)
        return y + grouped_matmul(hidden, b, layout, trainable=True, out_dtype=y.dtype)

    def merged_weight(self) -> jax.Array:
        """W + scale * B @ A per expert [..., E, out, in] in float32."""
        base = self.base
        w = nf4.dequantize(base.weight_nf4) if isinstance(base, NF4Experts) else base.weight[...].astype(jnp.float32)
        return w + self.scale * (self.lora_b[...].astype(jnp.float32) @ self.lora_a[...].astype(jnp.float32))


def expert_projection(module: nnx.Module, dtype: jnp.dtype, fp8: bool = False
                      ) -> tuple[ExpertProjection, float, float]:
    """(the arrays `moe.expert_mlp` takes for this projection, its LoRA scale, its LoRA dropout); `fp8`: the frozen
    weight as e4m3 W and Wᵀ with their scales (`fp8_expert_weights`, from the weight in `dtype`)."""
    base = module.base if isinstance(module, LoRAExperts) else module
    if isinstance(base, NF4Experts):
        weight = base.dequantized(dtype)
    elif isinstance(base, ExpertLinear):
        weight = base.weight[...].astype(dtype)
    else:
        raise TypeError(f"{type(base).__name__} is not an expert projection")
    if fp8:
        from pallas_kernels.grouped_fp8_matmul import fp8_expert_weights

        weight = fp8_expert_weights(weight)
    bias = _array(base.bias)
    if not isinstance(module, LoRAExperts):
        return ExpertProjection(weight, bias), 1.0, 0.0
    lora = ExpertProjection(weight, bias, module.lora_a[...].astype(dtype), module.lora_b[...].astype(dtype))
    return lora, module.scale, module.dropout
