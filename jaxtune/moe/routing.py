"""Top-k routing as Qwen3-MoE and Mixtral compute it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    weights: jax.Array  # [N, k] float32: each token's weight for each of its experts
    experts: jax.Array  # [N, k] int32: each token's experts, most probable first
    logits: jax.Array  # [N, E] float32: the router's logits (the load-balancing loss reads them)


@jax.custom_vjp
def router_logits_16bit(x: jax.Array, weight: jax.Array) -> jax.Array:
    """Float32 logits [N, E] of 16-bit tokens [N, H] and router [E, H]: one 16-bit GEMM accumulating in float32.
    Its VJP keeps the backward on tensor cores too: autodiff would contract the float32 cotangent with the 16-bit
    operands as a float32 (SIMT) GEMM. The cotangent is split into a 16-bit high part and a 16-bit remainder, two
    16-bit GEMMs each, whose float32 sum carries about 16 of the cotangent's bits (the operands are exact)."""
    return jax.lax.dot_general(x, weight, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _router_logits_fwd(x, weight):
    return router_logits_16bit(x, weight), (x, weight)


def _router_logits_bwd(residuals, g):
    from pallas_kernels.grouped_matmul import bf16_parts

    x, weight = residuals
    parts = [p.astype(x.dtype) for p in bf16_parts(g)]

    def two_part(dims, other):
        return sum(jax.lax.dot_general(part, other, dims, preferred_element_type=jnp.float32) for part in parts)

    dx = two_part((((1,), (0,)), ((), ())), weight)  # [N, E] @ [E, H]
    dw = two_part((((0,), (0,)), ((), ())), x)  # [N, E]ᵀ @ [N, H]
    return dx.astype(x.dtype), dw.astype(weight.dtype)


router_logits_16bit.defvjp(_router_logits_fwd, _router_logits_bwd)


def route(x: jax.Array, router_weight: jax.Array, top_k: int, normalize: bool,
          router_bias: jax.Array | None = None) -> Routing:
    """Softmax over all experts, the top k kept, renormalized to sum to 1 when `normalize` (Mixtral and gpt-oss
    always, whose softmax over the top k logits is this; Qwen3-MoE per `norm_topk_prob`). The router runs in
    float32 whatever the model's dtype: a token's experts are a discrete choice that bf16 logits would flip between
    near-ties. Where x and the weight are both 16-bit (a bf16 model), their products are exact in float32, so the
    logits are one 16-bit GEMM accumulating in float32 (tensor cores), the same values a float32 GEMM of them gives
    up to the order of the sums (`router_logits_16bit`, whose backward is on tensor cores too); otherwise a float32
    GEMM at full precision."""
    if x.dtype == router_weight.dtype and jnp.finfo(x.dtype).bits <= 16:
        logits = router_logits_16bit(x, router_weight)
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
