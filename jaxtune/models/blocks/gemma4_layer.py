"""Gemma 4's decoder layer: attention then the GeGLU MLP, each between two RMSNorms (one on its input, one on its
output before the residual add), and the layer's output times a learned scalar (frozen, as LoRA leaves it). The
mixture-of-experts variant runs routed GeGLU experts (`moe`) beside the dense MLP: each branch has its own input
and output norms, the router reads the un-normed hidden states, and the two outputs are summed before the MLP's
output norm. The small models (E2B, E4B) add each token's per-layer input after the MLP: the hidden states through
`per_layer_input_gate`, GeGLU-gated by the input, `per_layer_projection` and a norm, added to the residual; their
KV-sharing layers attend to an earlier layer's keys and values (`shared_kv`) with MLPs twice as wide where the config
says."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.models.blocks.attention import Attention
from jaxtune.models.blocks.mlp import MLP
from jaxtune.models.config import ModelConfig
from jaxtune.models.layer_kinds import DEFAULT, attention_window, kv_shared
from jaxtune.models.layers import Linear, RMSNorm
from jaxtune.moe.block import SparseMoE


class Gemma4DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, kind: str = DEFAULT):
        norm = lambda: RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Attention(cfg, dtype=dtype, rngs=rngs, sliding_window=attention_window(cfg, kind), kind=kind)
        wide = cfg.double_wide_mlp and kv_shared(kind)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs, width=2 * cfg.intermediate_size if wide else None)
        if cfg.per_layer_dim:
            h, p = cfg.hidden_size, cfg.per_layer_dim
            self.per_layer_input_gate = Linear(h, p, bias=False, dtype=dtype, rngs=rngs)
            self.per_layer_projection = Linear(p, h, bias=False, dtype=dtype, rngs=rngs)
            self.post_per_layer_input_norm = norm()
        else:
            self.per_layer_input_gate = None
        if cfg.num_experts:
            self.moe = SparseMoE(cfg, dtype=dtype, rngs=rngs)
            self.post_feedforward_layernorm_1, self.pre_feedforward_layernorm_2 = norm(), norm()
            self.post_feedforward_layernorm_2 = norm()
        else:
            self.moe = None
        self.layer_scalar = nnx.Param(jnp.ones((1,), dtype))

    def __call__(self, x, cos, sin, segment_ids, cache=None, cache_segment_ids=None, cache_index=None, rng=None,
                 mlp_token_tile=None, *, per_layer_input=None, shared_kv=None, kv_out=None
                 ) -> tuple[jax.Array, object]:
        attn, cache = self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, cache, cache_segment_ids,
                                     cache_index, rng, shared_kv=shared_kv, kv_out=kv_out)
        x = x + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(x), rng, mlp_token_tile)
        if self.moe is not None:
            routed = self.moe(self.pre_feedforward_layernorm_2(x), None if rng is None else jax.random.fold_in(rng, 8),
                              router_x=x)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(out)
        if self.per_layer_input_gate is not None:
            gated = jax.nn.gelu(self.per_layer_input_gate(x), approximate=True) * per_layer_input.astype(x.dtype)
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar[...], cache
