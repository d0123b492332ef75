"""QLoRA building blocks: frozen NF4 projections, LoRA adapters around any projection, and the model surgery.

Only `nnx.LoRAParam` variables are trainable; the NF4 arrays are `QuantizedWeight` variables, which
optimizers and `nnx.grad(..., wrt=nnx.LoRAParam)` never see.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from jaxtune import ops
from jaxtune.errors import ConfigError
from jaxtune.models.causal_lm import CausalLM, Linear
from jaxtune.moe.experts import ExpertLinear, LoRAExperts, NF4Experts
from jaxtune.parallel.sharding import whole_on_every_device
from jaxtune.quant import nf4
from jaxtune.quant.weights import DenseWeights, KernelScales, NF4Linear, QuantizedWeight  # noqa: F401 (public here too)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a hybrid decoder's Gated DeltaNet layers (Qwen3.5) hold these instead of q/k/v/o
LINEAR_ATTENTION_TARGETS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ALL_TARGETS = LORA_TARGETS + LINEAR_ATTENTION_TARGETS
PARENT_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp",
                 **{name: "linear_attn" for name in LINEAR_ATTENTION_TARGETS}}


class LoRALinear(nnx.Module):
    """base(x) + scale * (dropout(x) @ A.T) @ B.T with A [r, in] (kaiming-uniform, as PEFT), B [out, r] (zeros).

    Dropout applies only when the caller passes an rng (training); LoRA params are kept in float32.
    """

    def __init__(self, base: nnx.Module, in_features: int, out_features: int, *, r: int, alpha: float,
                 use_rslora: bool, key: jax.Array, leading: tuple[int, ...] = (), dropout: float = 0.0,
                 dtype=jnp.float32):
        self.base = base
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        self.lora_a = nnx.LoRAParam(jax.random.uniform(key, (*leading, r, in_features), dtype, -bound, bound))
        self.lora_b = nnx.LoRAParam(jnp.zeros((*leading, out_features, r), dtype))
        self.r, self.alpha, self.use_rslora = r, float(alpha), use_rslora
        self.scale = float(alpha) / (math.sqrt(r) if use_rslora else r)
        self.dropout = float(dropout)

    def __call__(self, x: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        fmt = ops.fake_quantize_format()
        if fmt is not None:
            return self._fake_quantized(x, fmt)
        y = self.base(x)
        if rng is not None and self.dropout > 0.0:
            keep = jax.random.bernoulli(rng, 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        a, b = whole_on_every_device(self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype))
        # the scale goes on the r-wide hidden, and the up-projection is a plain dot + add: a form XLA's GEMM
        # rewriter turns into one cuBLAS call accumulating onto y (no separate [tokens, out] product and add)
        hidden = checkpoint_name(ops.linear(x, a) * jnp.asarray(self.scale, x.dtype), "lora_hidden")
        return y + ops.linear(hidden, b, out_dtype=y.dtype)


    def merged_weight(self) -> jax.Array:
        """W + scale * B @ A [out, in] in float32 (the base dequantized when it is NF4)."""
        base = self.base
        w = nf4.dequantize(base.weight_nf4) if isinstance(base, NF4Linear) else base.weight[...].astype(jnp.float32)
        a, b = whole_on_every_device(self.lora_a[...].astype(jnp.float32), self.lora_b[...].astype(jnp.float32))
        return w + self.scale * (b @ a)

    def _fake_quantized(self, x: jax.Array, fmt: str) -> jax.Array:
        """QAT: y = x @ round_trip(W + scale * B @ A).T (+ bias), the exported model's output. Its gradient to A and
        B is the straight-through one (the rounding's derivative taken as 1), which is plain LoRA's: a LoRA term of
        value zero carries it, so no [out, in] weight gradient is ever formed; x's gradient is dy @ the rounded
        weight. The rounded weight is not differentiated (a remat policy recomputes it from the codes)."""
        from jaxtune.ops.fake_quant import fused_round_trip
        from jaxtune.quant.fake import round_trip

        weight = None
        if isinstance(self.base, NF4Linear):  # one kernel pass from the codes where it serves the format
            weight = fused_round_trip(self.base.weight_nf4, *(jax.lax.stop_gradient(p[...].astype(jnp.float32))
                                                              for p in (self.lora_a, self.lora_b)),
                                      self.scale, fmt, x.dtype)
        if weight is None:
            weight = round_trip(self.merged_weight(), fmt).astype(x.dtype)
        y = ops.linear(x, jax.lax.stop_gradient(weight))
        a, b = whole_on_every_device(self.lora_a[...].astype(x.dtype), self.lora_b[...].astype(x.dtype))
        lora = ops.linear(ops.linear(jax.lax.stop_gradient(x), a) * jnp.asarray(self.scale, x.dtype), b,
                          out_dtype=y.dtype)
        y = y + (lora - jax.lax.stop_gradient(lora))
        bias = self.base.bias
        return y if bias is None else (y.astype(jnp.float32) + bias[...].astype(jnp.float32)).astype(x.dtype)


def projection(model: CausalLM, name: str, stack: str = "layers") -> nnx.Module:
    """The stacked projection `name` (q_proj, ..., down_proj) of a stack of decoder layers (`layers`, or another
    kind's: `model.layer_stacks()`)."""
    return getattr(getattr(getattr(model, stack), PARENT_MODULE[name]), name)


def projection_names(layers: nnx.Module) -> list[str]:
    """The projections a stack of decoder layers holds: the 7 of attention and the MLP, or a Gated DeltaNet
    layer's 5 in place of attention's 4 (less v_proj where the keys serve as values: Gemma 4's full layers)."""
    return [name for name in ALL_TARGETS
            if getattr(getattr(layers, PARENT_MODULE[name], None), name, None) is not None]


def _projections(model: CausalLM):
    """(name, parent module, projection, its LayerStack) for the projections of every stack of decoder layers, a
    shared expert's and Gemma 4's routed experts' included."""
    for stack, layers in model.layer_stacks():
        for name in projection_names(layers):
            parent = getattr(layers, PARENT_MODULE[name])
            yield name, parent, getattr(parent, name), stack
        shared = getattr(getattr(layers, "mlp", None), "shared_expert", None)
        # a shared expert's projections, and Gemma 4's routed experts beside its dense MLP (`moe`), take the MLP's
        # names (gate_proj, ...)
        for beside in (shared, getattr(layers, "moe", None)):
            if beside is not None:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    yield name, beside, getattr(beside, name), stack


# one compiled program per weight shape: run op by op, the vmapped quantizer compiled a dozen small programs per
# projection (seconds per model on CPU, paid again by every process)
_quantize_stack = jax.jit(jax.vmap(nf4.quantize_traced))
_quantize_experts = jax.jit(jax.vmap(jax.vmap(nf4.quantize_traced)))


def quantize_layers(model: CausalLM) -> CausalLM:
    """Replaces every dense projection of the decoder layers by a frozen NF4 one (in place; returns model).

    Embeddings, norms and lm_head stay in the model dtype, and so does a projection whose rows are not whole
    64-weight blocks (a one-line warning names it; LoRA adapts it all the same). Works on abstract models too
    (eval_shape).
    """
    kept = []
    for name, parent, proj, _ in _projections(model):
        if not isinstance(proj, (Linear, ExpertLinear)):
            continue
        if not nf4.quantizable(proj.weight.shape):
            kept.append(f"{name} ({proj.weight.shape[-1]} inputs)")
            continue
        if isinstance(proj, ExpertLinear):  # each expert quantized on its own, as bnb does an expert's Linear
            setattr(parent, name, NF4Experts(_quantize_experts(proj.weight[...]),
                                             None if proj.bias is None else proj.bias[...]))
            continue
        q = _quantize_stack(proj.weight[...])
        setattr(parent, name, NF4Linear(q, None if proj.bias is None else proj.bias[...]))
    if kept:
        warnings.warn(f"{', '.join(kept)} kept in {jnp.dtype(model.dtype).name}, not NF4: jaxtune's NF4 quantizes rows "
                      f"of whole {nf4.BLOCK}-weight blocks", stacklevel=2)
    return model


def get_peft_model(
    model: CausalLM,
    *,
    r: int = 16,
    lora_alpha: float = 16,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = LORA_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
) -> CausalLM:
    """Wraps the target projections with LoRA adapters (in place; returns model). Only LoRA params train. Names a
    model does not have are skipped (a Gated DeltaNet layer's projections in a Llama), as long as one matches."""
    unknown = sorted(set(target_modules) - set(ALL_TARGETS))
    if unknown:
        raise ConfigError(f"unknown target module(s) {', '.join(unknown)}; valid: {', '.join(ALL_TARGETS)}")
    if not {name for name, *_ in _projections(model)} & set(target_modules):
        raise ConfigError(f"none of the target modules {', '.join(target_modules)} is in this model; it has "
                          f"{', '.join(dict.fromkeys(name for name, *_ in _projections(model)))}")
    if r < 1:
        raise ConfigError(f"LoRA rank r must be >= 1, got {r}")
    if not lora_alpha > 0:
        raise ConfigError(f"lora_alpha must be > 0, got {lora_alpha}")
    if not 0.0 <= lora_dropout < 1.0:
        raise ConfigError(f"lora_dropout must be in [0, 1), got {lora_dropout}; 0.0 to 0.1 is usual")
    cfg = model.config
    root = jax.random.key(seed)
    keys = {**dict(zip(LORA_TARGETS, jax.random.split(root, len(LORA_TARGETS)))),
            **dict(zip(LINEAR_ATTENTION_TARGETS, jax.random.split(jax.random.fold_in(root, 1),
                                                                   len(LINEAR_ATTENTION_TARGETS))))}
    stack_index = {stack.attr: k for k, (stack, _) in enumerate(model.layer_stacks())}
    for name, parent, proj, stack in _projections(model):
        if name not in target_modules:
            continue
        if isinstance(proj, (LoRALinear, LoRAExperts)):
            raise ConfigError(f"{name} already has a LoRA adapter; call get_peft_model once per model")
        key = keys[name] if stack.attr == "layers" else jax.random.fold_in(keys[name], stack_index[stack.attr])
        leading = (len(stack.layers),)
        out_f, in_f = _weight_features(proj)
        if isinstance(proj, (ExpertLinear, NF4Experts)):  # an adapter per expert
            setattr(parent, name, LoRAExperts(proj, cfg.num_experts, in_f, out_f, r=r, alpha=lora_alpha,
                                              use_rslora=use_rslora, key=key, leading=leading,
                                              dropout=lora_dropout))
            continue
        setattr(parent, name, LoRALinear(proj, in_f, out_f, r=r, alpha=lora_alpha, use_rslora=use_rslora,
                                         key=key, leading=leading, dropout=lora_dropout))
    return model


def _weight_features(proj) -> tuple[int, int]:
    """(out, in) of a frozen projection (dense or NF4, one or a stack of experts), read off its arrays: layers of
    several kinds may differ in width (Gemma 4's full-attention heads)."""
    codes = getattr(proj, "codes", None)
    if codes is not None:
        return codes.shape[-2], codes.shape[-1] * 2
    return tuple(proj.weight.shape[-2:])
