"""GRPO's objective: the clipped surrogate of the importance ratio times the advantage, an optional KL term to the
reference, and each loss type's normalization, term for term as TRL's GRPOTrainer computes them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtune.data.packing import IGNORE
from jaxtune.training.loss import chunked_token_logps_and_entropy

Batch = dict[str, jax.Array]


def per_token_loss(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None, advantages: jax.Array,
                   mask: jax.Array, *, epsilon_low: float, epsilon_high: float, delta: float | None = None,
                   beta: float = 0.0, importance_sampling_level: str = "token",
                   use_bias_correction_kl: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss of each completion token [B, T] (or [B, 1] at the sequence level, broadcast over T), per-token terms
    for the metrics) for log-probabilities [B, T] under the policy, the sampling policy and the reference,
    advantages [B] and the completion mask [B, T]."""
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
    coef_2 = jnp.clip(coef_1, 1.0 - epsilon_low, 1.0 + epsilon_high)
    if delta is not None:
        coef_1 = jnp.minimum(coef_1, delta)
    loss = -jnp.minimum(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        loss = loss + beta * terms["kl"]
    terms["low_clipped"] = ((coef_1 < 1.0 - epsilon_low) & (adv < 0)).astype(jnp.float32)
    terms["high_clipped"] = ((coef_1 > 1.0 + epsilon_high) & (adv > 0)).astype(jnp.float32)
    return loss, terms


@dataclasses.dataclass(frozen=True)
class GRPO:
    """The step's objective over rollout rows: each row one prompt + completion, labels the completion's tokens,
    with `advantages` [B, 1], `old_logps` [B, T] when the batch is stepped on more than once (num_iterations > 1;
    otherwise the ratio is 1 and its gradient the policy gradient) and the reference's log-probabilities computed
    here with the adapters off when beta > 0 (as DPO's reference).

    Normalizers over the whole step (completions, tokens), so the sum over micro-batches is the step's loss
    however it is split; bnpo normalizes each micro-batch by its own tokens and divides by the micro-batch count,
    as TRL does.
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
    name = "grpo"
    eval_weight = "completions"

    @property
    def metric_names(self) -> tuple[str, ...]:
        names = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
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
        if self.temperature != 1.0:  # logits / T, as hidden / T through the (linear) head
            hidden = hidden / jnp.asarray(self.temperature, hidden.dtype)
        return chunked_token_logps_and_entropy(hidden, model.head_weight(), micro["labels"], chunk_size=chunk_size)

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
        """(the micro-batch's share of the step's loss, metrics) from its completions' log-probabilities [B, T]
        under the policy, the sampling policy and the reference (None when beta is 0), entropies, advantages [B]
        and the completion mask."""
        loss, terms = per_token_loss(logps, old_logps, ref_logps, advantages, mask, epsilon_low=self.epsilon_low,
                                     epsilon_high=self.epsilon_high, delta=self.delta, beta=self.beta,
                                     importance_sampling_level=self.importance_sampling_level,
                                     use_bias_correction_kl=self.use_bias_correction_kl)
        masked = jnp.sum(loss * mask, -1)  # [B]
        if self.loss_type == "grpo":
            total = jnp.sum(masked / jnp.maximum(jnp.sum(mask, -1), 1.0)) / weights["completions"]
        elif self.loss_type == "bnpo":
            total = jnp.sum(masked) / jnp.maximum(jnp.sum(mask), 1.0) / weights["micro_batches"]
        elif self.loss_type == "dr_grpo":
            total = jnp.sum(masked) / (weights["completions"] * self.max_completion_length)
        else:  # dapo: over every completion token of the step
            total = jnp.sum(masked) / weights["tokens"]

        def mean(x):  # over tokens, or over completions for a per-sequence term (GSPO's ratios), as TRL logs
            if x.shape[-1] == 1:
                return jnp.sum(x) / weights["completions"]
            return jnp.sum(x * mask) / weights["tokens"]

        low, high = terms["low_clipped"], terms["high_clipped"]
        metrics = {"entropy": mean(entropy), "clip_ratio/low_mean": mean(low), "clip_ratio/high_mean": mean(high),
                   "clip_ratio/region_mean": mean(jnp.maximum(low, high))}
        if self.beta != 0.0:
            metrics["kl"] = mean(terms["kl"])
        return total, jax.lax.stop_gradient(metrics)
