"""Gated DeltaNet linear attention (Qwen3.5's `linear_attention` layers), as transformers computes it.

    qkv = in_proj_qkv(x) -> causal depthwise conv1d (kernel linear_conv_kernel_dim) -> SiLU -> q, k, v heads
    q, k L2-normalised; beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = gated delta rule(q, k, v, g, beta)   (jaxtune/ops/gated_delta.py: chunks of 64, the state in float32)
    out_proj(RMSNorm(o) * silu(in_proj_z(x)))  per value head

Packed rows restart both the convolution's window and the recurrent state at every segment start. The four input
projections and out_proj are frozen linears like any other (NF4 + LoRA); A_log, dt_bias, the conv and norm weights
stay as the checkpoint has them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtune.models import input_stats
from jaxtune.models.config import ModelConfig
from jaxtune.models.dropout_keys import fold_rng
from jaxtune.ops import dispatch
from jaxtune.ops.gated_delta import gated_delta_rule_chunked, gated_delta_rule_recurrent
from pallas_kernels.gated_delta import gated_delta_rule_pallas

PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


class LinearCache(NamedTuple):
    """What decoding carries for the Gated DeltaNet layers, stacked over them: the conv window (the last K - 1
    inputs of the row's segment) [L, B, K - 1, C] and the recurrent state [L, B, Hv, dk, dv] (float32); `layer`
    this layer's index in the stacks."""

    conv: jax.Array
    state: jax.Array
    layer: jax.Array | int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, layers: int, batch: int, dtype: jnp.dtype) -> "LinearCache":
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        channels = 2 * key + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        return cls(jnp.zeros((layers, batch, cfg.linear_conv_kernel_dim - 1, channels), dtype),
                   jnp.zeros((layers, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                              cfg.linear_value_head_dim), jnp.float32))


class DepthwiseConv(nnx.Module):
    """The causal depthwise convolution's weight [channels, 1, kernel], as the checkpoint stores it."""

    def __init__(self, channels: int, kernel: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(0.02 * jax.random.normal(rngs.params(), (channels, 1, kernel), dtype))

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, window: jax.Array | None = None) -> jax.Array:
        """x [B, T, C] -> causal conv over T (zeros before each segment's first token), float32; `window`
        [B, K - 1, C]: the inputs before x (decoding), of the first token's segment."""
        w = self.weight[...][:, 0, :].astype(jnp.float32)  # [C, K]
        kernel, t = w.shape[-1], x.shape[1]
        if window is not None:  # the window's tokens precede x, in its first token's segment
            x = jnp.concatenate([window.astype(x.dtype), x], axis=1)
            if segment_ids is not None:
                segment_ids = jnp.concatenate(
                    [jnp.broadcast_to(segment_ids[:, :1], (x.shape[0], kernel - 1)), segment_ids], axis=1)
            return self(x, segment_ids)[:, kernel - 1:]
        xf = x.astype(jnp.float32)
        out = jnp.zeros_like(xf)
        for shift in range(kernel):  # out[t] = sum_s w[K - 1 - s] * x[t - s], within the segment of t
            shifted = jnp.pad(xf, ((0, 0), (shift, 0), (0, 0)))[:, :t]
            if segment_ids is not None and shift:
                seg = jnp.pad(segment_ids, ((0, 0), (shift, 0)), constant_values=-1)[:, :t]
                shifted = jnp.where((seg == segment_ids)[..., None], shifted, 0.0)
            out = out + shifted * w[:, kernel - 1 - shift]
        return out


class GatedRMSNorm(nnx.Module):
    """RMSNorm of each value head's output, times silu(gate)."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        out = self.weight[...] * normed
        return (out.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _in_dtype(rule, dtype, q, k, v, g, beta, **kw):
    return rule(q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, **kw)


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, linear, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.in_proj_qkv = linear(h, 2 * key_dim + value_dim, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_z = linear(h, value_dim, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_b = linear(h, self.num_v_heads, bias=False, dtype=dtype, rngs=rngs)
        self.in_proj_a = linear(h, self.num_v_heads, bias=False, dtype=dtype, rngs=rngs)
        self.out_proj = linear(value_dim, h, bias=False, dtype=dtype, rngs=rngs)
        self.conv1d = DepthwiseConv(2 * key_dim + value_dim, cfg.linear_conv_kernel_dim, dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, self.num_v_heads)).astype(dtype))
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), dtype))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x: jax.Array, segment_ids: jax.Array | None, rng: jax.Array | None = None,
                 cache: LinearCache | None = None) -> tuple[jax.Array, LinearCache | None]:
        """(out, the cache with this layer's window and state written) for x [B, T, H]; without a cache the
        state starts at zero (training, scoring)."""
        b, t, _ = x.shape
        input_stats.observe(PROJECTIONS[:4], x)
        key_dim = self.num_k_heads * self.head_k_dim
        qkv = checkpoint_name(self.in_proj_qkv(x, fold_rng(rng, 10)), "in_proj_qkv")
        window = state = None
        if cache is not None:
            window = jax.lax.dynamic_index_in_dim(cache.conv, cache.layer, 0, keepdims=False)
            state = jax.lax.dynamic_index_in_dim(cache.state, cache.layer, 0, keepdims=False)
        mixed = jax.nn.silu(self.conv1d(qkv, segment_ids, window)).astype(x.dtype)
        z = checkpoint_name(self.in_proj_z(x, fold_rng(rng, 11)), "in_proj_z").reshape(b, t, self.num_v_heads,
                                                                                self.head_v_dim)
        beta = jax.nn.sigmoid(checkpoint_name(self.in_proj_b(x, fold_rng(rng, 12)), "in_proj_b").astype(jnp.float32))
        a = checkpoint_name(self.in_proj_a(x, fold_rng(rng, 13)), "in_proj_a").astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a + self.dt_bias[...].astype(jnp.float32))
        q = mixed[..., :key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = mixed[..., key_dim:2 * key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = mixed[..., 2 * key_dim:].reshape(b, t, self.num_v_heads, self.head_v_dim)
        if cache is not None and t == 1:
            rule = gated_delta_rule_recurrent
        elif dispatch.gated_delta_impl(self.head_k_dim, self.head_v_dim) == "pallas":
            # the kernel's dots read q, k, v in the activations' dtype (bf16 in training), as fla's do
            rule = functools.partial(_in_dtype, gated_delta_rule_pallas, x.dtype, interpret=dispatch.interpret())
        else:
            rule = gated_delta_rule_chunked
        out, state = rule(_l2norm(q), _l2norm(k), v.astype(jnp.float32), g, beta, segment_ids=segment_ids,
                          initial_state=state)
        out = checkpoint_name(out, "linear_attention_out")
        if cache is not None:
            cache = self._written(cache, qkv, segment_ids, window, state)
        out = self.norm(out.astype(x.dtype), z).reshape(b, t, -1)
        input_stats.observe(("out_proj",), out)
        return self.out_proj(out, fold_rng(rng, 14)), cache

    @staticmethod
    def _written(cache: LinearCache, qkv, segment_ids, window, state) -> LinearCache:
        """The cache with the new window (the last K - 1 inputs, zero where they are not the last token's segment)
        and state at this layer."""
        keep = window.shape[1]
        full = jnp.concatenate([window.astype(qkv.dtype), qkv], axis=1)[:, -keep:]
        if segment_ids is not None:
            seg = jnp.concatenate([jnp.broadcast_to(segment_ids[:, :1], (qkv.shape[0], keep)), segment_ids], 1)[:, -keep:]
            full = jnp.where((seg == segment_ids[:, -1:])[..., None], full, 0)
        conv = jax.lax.dynamic_update_index_in_dim(cache.conv, full.astype(cache.conv.dtype), cache.layer, 0)
        states = jax.lax.dynamic_update_index_in_dim(cache.state, state.astype(jnp.float32), cache.layer, 0)
        return LinearCache(conv, states, cache.layer)
