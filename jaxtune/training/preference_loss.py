"""DPO and ORPO losses on sequence log-probabilities, with the metrics TRL logs under the same names.

Pure functions of per-pair arrays [B, P] (P pairs per row, `mask` 1 where a pair exists): the step sums each
pair's token log-probabilities out of a packed row (`sequence_sums`) and hands them here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtune.training.config import DPO_LOSSES


def sequence_sums(values: jax.Array, segment_ids: jax.Array, pairs: int) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) sums of values [B, T] over each pair's sequences: pair k's chosen sequence is segment
    2k+1 of its row, its rejected one 2k+2; both [B, pairs], float32."""
    rows = values.shape[0]
    slots = 2 * pairs + 1  # segment 0 is padding
    index = (jnp.arange(rows)[:, None] * slots + jnp.clip(segment_ids, 0, slots - 1)).reshape(-1)
    sums = jax.ops.segment_sum(values.astype(jnp.float32).reshape(-1), index, num_segments=rows * slots)
    sums = sums.reshape(rows, slots)[:, 1:]
    return sums[:, 0::2], sums[:, 1::2]


def dpo_loss(chosen: jax.Array, rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array, *,
             beta: float, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_tokens: jax.Array | None = None, rejected_tokens: jax.Array | None = None) -> jax.Array:
    """Per-pair DPO loss from summed response log-probabilities of the policy and the reference.

    sigmoid: -log σ(β Δ), with label smoothing ε the conservative form -(1-ε) log σ(β Δ) - ε log σ(-β Δ);
    ipo: (Δ/len - 1/(2β))², the log-ratios averaged over each response's tokens (as TRL does);
    robust: (-(1-ε) log σ(β Δ) + ε log σ(-β Δ)) / (1 - 2ε). Δ = (chosen - ref_chosen) - (rejected - ref_rejected).
    """
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * delta) - label_smoothing * jax.nn.log_sigmoid(
            -beta * delta)
    if loss_type == "robust":
        return (-(1 - label_smoothing) * jax.nn.log_sigmoid(beta * delta)
                + label_smoothing * jax.nn.log_sigmoid(-beta * delta)) / (1 - 2 * label_smoothing)
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss averages over response tokens: pass chosen_tokens and rejected_tokens")
        average = (chosen_ratio / jnp.maximum(chosen_tokens, 1.0) - rejected_ratio / jnp.maximum(rejected_tokens, 1.0))
        return (average - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss {loss_type!r}; choose one of: {', '.join(DPO_LOSSES)}")


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def orpo_log_odds(chosen_mean: jax.Array, rejected_mean: jax.Array) -> jax.Array:
    """log odds(chosen) - log odds(rejected), odds(y) = p / (1 - p) of the mean token log-probability."""
    return (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))


def reward_metrics(chosen_rewards: jax.Array, rejected_rewards: jax.Array, chosen_logps: jax.Array,
                   rejected_logps: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """Sums over the existing pairs of what TRL logs per pair (the step divides by the number of pairs)."""
    total = lambda x: jnp.sum(jnp.where(mask, x, 0.0))  # noqa: E731
    return {"rewards/chosen": total(chosen_rewards), "rewards/rejected": total(rejected_rewards),
            "rewards/accuracies": total((chosen_rewards > rejected_rewards).astype(jnp.float32)),
            "rewards/margins": total(chosen_rewards - rejected_rewards),
            "logps/chosen": total(chosen_logps), "logps/rejected": total(rejected_logps)}
