"""Top-k routing as Qwen3-MoE and Mixtral compute it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    weights: jax.Array  # [N, k] float32: each token's weight for each of its experts
    experts: jax.Array  # [N, k] int32: each token's experts, most probable first
    logits: jax.Array  # [N, E] float32: the router's logits (the load-balancing loss reads them)


def route(x: jax.Array, router_weight: jax.Array, top_k: int, normalize: bool,
          router_bias: jax.Array | None = None) -> Routing:
    """Softmax over all experts, the top k kept, renormalized to sum to 1 when `normalize` (Mixtral and gpt-oss
    always, whose softmax over the top k logits is this; Qwen3-MoE per `norm_topk_prob`). The router runs in
    float32 whatever the model's dtype: a token's experts are a discrete choice that bf16 logits would flip between
    near-ties. Where x and the weight are both 16-bit (a bf16 model), their products are exact in float32, so the
    logits are one 16-bit GEMM accumulating in float32 (tensor cores), the same values a float32 GEMM of them gives
    up to the order of the sums; otherwise a float32 GEMM at full precision."""
    if x.dtype == router_weight.dtype and jnp.finfo(x.dtype).bits <= 16:
        logits = jax.lax.dot_general(x, router_weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        logits = jnp.dot(x.astype(jnp.float32), router_weight.astype(jnp.float32).T,
                         precision=jax.lax.Precision.HIGHEST)
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, experts.astype(jnp.int32), logits)
