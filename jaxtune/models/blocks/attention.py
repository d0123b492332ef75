"""Causal self-attention with grouped KV heads, optional q/k norms, RoPE (partial where a family sets it), a
sigmoid output gate (Qwen3.5), Gemma 4's scale-free value norm, keys serving as values and unscaled logits, and a KV
cache for decoding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtune import ops
from jaxtune.models import input_stats
from jaxtune.models.cache import LayerCache
from jaxtune.models.config import ModelConfig
from jaxtune.models.dropout_keys import fold_rng
from jaxtune.models.layer_kinds import DEFAULT, attention_geometry, kv_shared
from jaxtune.models.layers import Linear, RMSNorm, rms_normalize
from jaxtune.models.rope import apply_rope


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, sliding_window: int | None = None,
                 kind: str = DEFAULT):
        h = cfg.hidden_size
        d, kv_heads, k_eq_v = attention_geometry(cfg, kind)
        # with an output gate (Qwen3.5), q_proj yields each head's query then its gate
        self.output_gate = cfg.attn_output_gate
        self.q_proj = Linear(h, cfg.num_heads * d * (2 if self.output_gate else 1), bias=cfg.qkv_bias, dtype=dtype,
                             rngs=rngs)
        # Gemma 4's KV-sharing layers have no keys and values of their own (`shared_kv` in the call)
        shared = kv_shared(kind)
        self.k_proj = None if shared else Linear(h, kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        # Gemma 4's full layers: the keys' projection serves as the values' too (before the key norm and RoPE)
        self.v_proj = (None if k_eq_v or shared else
                       Linear(h, kv_heads * d, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs))
        self.o_proj = Linear(cfg.num_heads * d, h, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, kv_heads, d
        # Gemma 4: values RMS-normalized without a scale; attention logits scaled by `attention_scale`, folded into
        # q (times sqrt(d), which the kernels' 1/sqrt(d) undoes) where q is normalized, in float32
        self.v_norm_eps = cfg.rms_norm_eps if cfg.v_norm else None
        self.q_scale = None if cfg.attention_scale is None else cfg.attention_scale * d**0.5
        self.sliding_window = sliding_window
        # gpt-oss: a learned logit per head in the softmax's denominator (frozen: LoRA leaves it)
        self.sinks = nnx.Param(jnp.zeros((cfg.num_heads,), dtype)) if cfg.attention_sinks else None
        # Qwen3: per-head RMSNorm on q and k (weights [head_dim], shared by the heads), before RoPE
        norm = lambda: RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dtype, offset=cfg.norm_offset)  # noqa: E731
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm and not shared else None

    def __call__(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        segment_ids: jax.Array | None,
        cache: LayerCache | None = None,
        cache_segment_ids: jax.Array | None = None,
        cache_index: jax.Array | None = None,
        rng: jax.Array | None = None,
        *,
        shared_kv: tuple[jax.Array, jax.Array] | None = None,
        kv_out: list | None = None,
    ) -> tuple[jax.Array, LayerCache | None]:
        """`shared_kv`: a KV-sharing layer's keys and values (another layer's, normed and rotated) where there is no
        cache (with one, the cache passed is that layer's, read and never written). `kv_out`: a list the keys and
        values attended to are appended to (the cache's, after this layer's write), for the layers sharing them."""
        b, t, _ = x.shape
        input_stats.observe(("q_proj", "k_proj", "v_proj"), x)
        # q and k never run their forward in FP8: their product is the exponent of the softmax, which turns FP8's
        # ~4% error into a measurably worse loss (the other projections in FP8 leave it unchanged;
        # benchmarks/results). Their input gradient adds into the residual stream's like every other projection's,
        # so under "fp8" it is an FP8 GEMM too.
        with ops.frozen_compute("fp8-dx" if ops.frozen_compute_mode() == "fp8" else "bf16"):
            q = checkpoint_name(self.q_proj(x, fold_rng(rng, 0)), "q_proj")
            if self.output_gate:
                q = q.reshape(b, t, self.num_heads, 2 * self.head_dim)
                q, gate = q[..., :self.head_dim], q[..., self.head_dim:].reshape(b, t, -1)
            q = q.reshape(b, t, self.num_heads, self.head_dim)
            if self.k_proj is not None:
                k = checkpoint_name(self.k_proj(x, fold_rng(rng, 1)), "k_proj")
                k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q, self.q_scale)
        elif self.q_scale is not None:
            q = (q.astype(jnp.float32) * self.q_scale).astype(q.dtype)
        q = apply_rope(q, cos, sin)
        if self.k_proj is None:  # a KV-sharing layer: another layer's keys and values (or its cache), as they are
            k, v = shared_kv if cache is None else (cache.k, cache.v)
        else:
            v = (k if self.v_proj is None else checkpoint_name(self.v_proj(x, fold_rng(rng, 2)), "v_proj").reshape(
                b, t, self.num_kv_heads, self.head_dim))
            if self.v_norm_eps is not None:
                v = rms_normalize(v, self.v_norm_eps).astype(v.dtype)
            if self.k_norm is not None:
                k = self.k_norm(k)
            k = apply_rope(k, cos, sin)
            if cache is not None:
                stacked = cache.layer is not None  # every layer's stack at this layer, or this layer's own arrays
                lead = (cache.layer,) if stacked else ()

                def write(stack, new):
                    new = (new[None] if stacked else new).astype(stack.dtype)
                    return jax.lax.dynamic_update_slice(stack, new, (*lead, 0, cache_index, 0, 0))

                def read(stack):
                    return jax.lax.dynamic_index_in_dim(stack, cache.layer, 0, keepdims=False) if stacked else stack

                cache = LayerCache(write(cache.k, k), write(cache.v, v), cache.layer)
                k, v = read(cache.k), read(cache.v)
            if kv_out is not None:
                kv_out.append((k, v))
        cached = cache is not None
        out = ops.attention(q, k.astype(q.dtype), v.astype(q.dtype), q_segment_ids=segment_ids,
                            kv_segment_ids=cache_segment_ids if cached else None,
                            q_offset=cache_index if cached else 0, sliding_window=self.sliding_window,
                            sinks=self._sinks())
        out = out.reshape(b, t, self.num_heads * self.head_dim)
        if self.output_gate:
            out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
        input_stats.observe(("o_proj",), out)
        out = self.o_proj(out, fold_rng(rng, 3))
        return checkpoint_name(out, "o_proj"), cache

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...]
