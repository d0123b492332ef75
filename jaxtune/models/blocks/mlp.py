"""The gated MLP (SwiGLU, or Gemma 4's GeGLU), with token tiles for long-context training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtune import ops
from jaxtune.models import input_stats
from jaxtune.models.config import ModelConfig
from jaxtune.models.dropout_keys import fold_rng
from jaxtune.models.layers import Linear


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs, width: int | None = None):
        h, i = cfg.hidden_size, width or cfg.intermediate_size
        self.gate_proj = Linear(h, i, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"  # GeGLU (tanh-approximated GELU), else SwiGLU

    def __call__(self, x: jax.Array, rng: jax.Array | None = None, token_tile: int | None = None) -> jax.Array:
        """SwiGLU. With `token_tile`, long inputs run `token_tile` tokens at a time, each tile rematerialized,
        so the [tokens, intermediate] activations of only one tile are ever alive (long-context training)."""
        b, t, hidden = x.shape
        if token_tile is None or b * t <= token_tile:
            return self._swiglu(x, rng)
        n = b * t
        tiles = -(-n // token_tile)
        # equal tiles, a multiple of 128 tokens where that stays within the limit: little padding
        token_tile = min(token_tile, -(-(-(-n // tiles)) // 128) * 128)
        flat = jnp.pad(x.reshape(n, hidden), ((0, tiles * token_tile - n), (0, 0)))

        @jax.checkpoint
        def one_tile(args):
            xt, i = args
            return self._swiglu(xt[None], None if rng is None else jax.random.fold_in(rng, i))[0]

        out = jax.lax.map(one_tile, (flat.reshape(tiles, token_tile, hidden), jnp.arange(tiles)))
        return out.reshape(tiles * token_tile, hidden)[:n].reshape(b, t, hidden)

    def _swiglu(self, x: jax.Array, rng: jax.Array | None) -> jax.Array:
        input_stats.observe(("gate_proj", "up_proj"), x)
        gate = checkpoint_name(self.gate_proj(x, fold_rng(rng, 4)), "gate_proj")
        # gate and up read the same input, so dequantizing at use alone lets XLA dequantize both weights before
        # either GEMM; up's input waiting for gate's output keeps one alive at a time (gate's value itself does
        # not pass the barrier, so no rounding moves: the same gradients)
        x_up, _ = ops.barrier(ops.dequantizing_at_use(), x, gate)
        act = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        h = act * checkpoint_name(self.up_proj(x_up, fold_rng(rng, 5)), "up_proj")
        input_stats.observe(("down_proj",), h)
        return self.down_proj(h, fold_rng(rng, 6))
