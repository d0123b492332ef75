"""GRPO's objective: the clipped surrogate of the importance ratio times the advantage, an optional KL term to the
reference, and each loss type's normalization, term for term as TRL's GRPOTrainer computes them."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.data.packing import IGNORE
from jaxtune.training.loss import chunked_token_logps_and_entropy

Batch = dict[str, jax.Array]


CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # the clipped surrogate, each its normalization
VESPO_LOG_FLOOR = math.log(1e-8)  # VESPO's clamp of the sequence's log-ratio (its reference implementation's)


def vespo_weights(advantages: jax.Array, log_ratio: jax.Array, mask: jax.Array, *, k_pos: float, lambda_pos: float,
                  k_neg: float, lambda_neg: float) -> jax.Array:
    """VESPO's gamma weight phi(w) = e^lambda w^k e^(-lambda w) of each completion's sequence ratio w (the product
    of its tokens' ratios), k and lambda by the advantage's sign [B, 1]; a coefficient only (no gradient)."""
    seq = jnp.sum(jnp.clip(log_ratio, -20.0, 20.0) * mask, -1, keepdims=True)
    log_w = jnp.clip(seq, VESPO_LOG_FLOOR, 20.0)
    nonneg = advantages >= 0
    k = jnp.where(nonneg, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(nonneg, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def per_token_loss(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None, advantages: jax.Array,
                   mask: jax.Array, *, epsilon_low: float, epsilon_high: float, delta: float | None = None,
                   beta: float = 0.0, importance_sampling_level: str = "token",
                   use_bias_correction_kl: bool = True, loss_type: str = "dapo",
                   sapo_temperatures: tuple[float, float] = (1.0, 1.05),
                   vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss of each completion token [B, T] (or [B, 1] at the sequence level, broadcast over T), per-token terms
    for the metrics) for log-probabilities [B, T] under the policy, the sampling policy and the reference,
    advantages [B] and the completion mask [B, T].

    The clipped surrogate (CLIPPED_LOSSES); CISPO's policy gradient weighted by the detached ratio capped at
    epsilon_high; SAPO's sigmoid-softened ratio (temperatures (positive, negative advantage)); VESPO's policy
    gradient weighted by the detached gamma weight of the sequence ratio (k, lambda for positive, then negative
    advantages)."""
    log_ratio = logps - old_logps
    if importance_sampling_level == "sequence":  # GSPO: one ratio per completion, the mean of its tokens' log-ratios
        log_weights = (jnp.sum(log_ratio * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))[:, None]
    else:
        log_weights = log_ratio
    coef_1 = jnp.exp(log_weights)
    adv = advantages[:, None]
    terms = {}
    if beta != 0.0:
        kl = jnp.exp(ref_logps - logps) - (ref_logps - logps) - 1.0
        if use_bias_correction_kl:
            kl = kl * coef_1
        terms["kl"] = kl
    if loss_type == "cispo":
        loss = -jax.lax.stop_gradient(jnp.minimum(coef_1, epsilon_high)) * adv * logps
        terms["cispo_clipped"] = ((coef_1 > epsilon_high) & (adv > 0)).astype(jnp.float32)
    elif loss_type == "sapo":
        temperature = jnp.where(adv > 0, sapo_temperatures[0], sapo_temperatures[1])
        loss = -(jax.nn.sigmoid(temperature * (coef_1 - 1.0)) * 4.0 / temperature) * adv
    elif loss_type == "vespo":
        k_pos, lambda_pos, k_neg, lambda_neg = vespo
        phi = vespo_weights(adv, log_ratio, mask, k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg,
                            lambda_neg=lambda_neg)
        loss = -phi * adv * logps
        terms["phi"] = phi
    else:
        coef_2 = jnp.clip(coef_1, 1.0 - epsilon_low, 1.0 + epsilon_high)
        if delta is not None:
            coef_1 = jnp.minimum(coef_1, delta)
        loss = -jnp.minimum(coef_1 * adv, coef_2 * adv)
        terms["low_clipped"] = ((coef_1 < 1.0 - epsilon_low) & (adv < 0)).astype(jnp.float32)
        terms["high_clipped"] = ((coef_1 > 1.0 + epsilon_high) & (adv > 0)).astype(jnp.float32)
    if beta != 0.0:
        loss = loss + beta * terms["kl"]
    return loss, terms


@dataclasses.dataclass(frozen=True)
class GRPO:
    """The step's objective over rollout rows: each row one prompt + completion, labels the completion's tokens,
    with `advantages` [B, 1], `old_logps` [B, T] when the batch is stepped on more than once (num_iterations > 1;
    otherwise the ratio is 1 and its gradient the policy gradient) and the reference's log-probabilities computed
    here with the adapters off when beta > 0 (as DPO's reference).

    Normalizers over the whole step (completions, tokens), so the sum over micro-batches is the step's loss
    however it is split; bnpo normalizes each micro-batch by its own tokens and divides by the micro-batch count,
    as TRL does. The metrics are TRL's too: each micro-batch's own token mean, averaged over the micro-batches.
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    max_completion_length: int = 512
    temperature: float = 1.0  # log-probabilities of the distribution sampled from: logits / temperature, as TRL
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    name = "grpo"
    eval_weight = "completions"

    @property
    def metric_names(self) -> tuple[str, ...]:
        names: tuple[str, ...] = ("entropy",)
        if self.loss_type in CLIPPED_LOSSES:
            names += ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                      "clip_ratio/high_max")
        elif self.loss_type == "cispo":
            names += ("cispo_clip_ratio",)
        elif self.loss_type == "vespo":
            names += ("vespo/phi_seq_mean",)
        return names + (("kl",) if self.beta != 0.0 else ())

    def weights(self, batch: Batch) -> dict[str, jax.Array]:
        """Counts over the whole step [accum, B, T]: completions (rows, a masked one included, as TRL's mean over
        the batch), completion tokens, micro-batches."""
        accum, rows = batch["labels"].shape[:2]
        return {"completions": jnp.float32(accum * rows),
                "tokens": jnp.maximum(jnp.sum(batch["labels"] != IGNORE), 1).astype(jnp.float32),
                "micro_batches": jnp.float32(accum)}

    def token_logps(self, model, micro: Batch, chunk_size: int):
        """(log-probabilities, entropies) of each row's label tokens [B, T]."""
        hidden = model.hidden_states(micro["input_ids"], micro["positions"], micro["segment_ids"])
        return chunked_token_logps_and_entropy(hidden, model.head_weight(), micro["labels"], chunk_size=chunk_size,
                                               softcap=model.config.final_logit_softcapping,
                                               temperature=self.temperature)

    def micro_loss(self, graphdef, lora, frozen, micro: Batch, rng, chunk_size: int, weights) -> tuple:
        frozen, reference = frozen if isinstance(frozen, tuple) else (frozen, None)
        logps, entropy = self.token_logps(nnx.merge(graphdef, lora, frozen), micro, chunk_size)
        mask = (micro["labels"] != IGNORE).astype(jnp.float32)
        old = micro["old_logps"] if "old_logps" in micro else jax.lax.stop_gradient(logps)
        ref = None
        if self.beta != 0.0:  # the reference: the model as the run began (fresh adapters are zero: switched off)
            off = reference if reference is not None else jax.tree.map(jnp.zeros_like, jax.lax.stop_gradient(lora))
            ref = jax.lax.stop_gradient(self.token_logps(nnx.merge(graphdef, off, frozen), micro, chunk_size)[0])
        return self.loss_from_logps(logps, entropy, old, ref, micro["advantages"][:, 0], mask, weights)

    def loss_from_logps(self, logps, entropy, old_logps, ref_logps, advantages, mask, weights) -> tuple:
        """(the micro-batch's share of the step's loss, its share of the step's metrics) from its completions'
        log-probabilities [B, T] under the policy, the sampling policy and the reference (None when beta is 0),
        entropies, advantages [B] and the completion mask."""
        loss, terms = per_token_loss(
            logps, old_logps, ref_logps, advantages, mask, epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high, delta=self.delta, beta=self.beta,
            importance_sampling_level=self.importance_sampling_level,
            use_bias_correction_kl=self.use_bias_correction_kl, loss_type=self.loss_type,
            sapo_temperatures=(self.sapo_temperature_pos, self.sapo_temperature_neg),
            vespo=(self.vespo_k_pos, self.vespo_lambda_pos, self.vespo_k_neg, self.vespo_lambda_neg))
        masked = jnp.sum(loss * mask, -1)  # [B]
        if self.loss_type in ("grpo", "sapo"):
            total = jnp.sum(masked / jnp.maximum(jnp.sum(mask, -1), 1.0)) / weights["completions"]
        elif self.loss_type == "bnpo":
            total = jnp.sum(masked) / jnp.maximum(jnp.sum(mask), 1.0) / weights["micro_batches"]
        elif self.loss_type == "dr_grpo":
            total = jnp.sum(masked) / (weights["completions"] * self.max_completion_length)
        elif self.loss_type == "luspo":  # each completion's summed loss, averaged over completions
            total = jnp.sum(masked) / weights["completions"]
        else:  # dapo, cispo, vespo: over every completion token of the step
            total = jnp.sum(masked) / weights["tokens"]
        share = 1.0 / weights["micro_batches"]  # TRL logs each micro-batch's mean; the step their average

        def mean(x):  # over the micro-batch's tokens, or its completions for a per-sequence term (GSPO's ratios)
            if x.shape[-1] == 1:
                return jnp.mean(x) * share
            return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0) * share

        def per_completion(x):  # each completion's mean over its tokens; NaN for one with none, as TRL's
            return x[:, 0] if x.shape[-1] == 1 else jnp.sum(x * mask, -1) / jnp.sum(mask, -1)

        metrics = {"entropy": mean(entropy)}
        if self.loss_type in CLIPPED_LOSSES:
            low, high = terms["low_clipped"], terms["high_clipped"]
            metrics.update({"clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                            "clip_ratio/region_mean": mean(jnp.maximum(low, high)),
                            "clip_ratio/low_min": jnp.nanmin(per_completion(low)) * share,
                            "clip_ratio/high_max": jnp.nanmax(per_completion(high)) * share})
        elif self.loss_type == "cispo":
            metrics["cispo_clip_ratio"] = mean(terms["cispo_clipped"])
        elif self.loss_type == "vespo":
            metrics["vespo/phi_seq_mean"] = mean(terms["phi"])
        if self.beta != 0.0:
            metrics["kl"] = mean(terms["kl"])
        return total, jax.lax.stop_gradient(metrics)
