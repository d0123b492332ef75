"""What a step minimizes: next-token cross-entropy (SFT), DPO or ORPO, over one micro-batch.

An objective's `weights(batch)` are counts over the WHOLE batch (label tokens, pairs), and its `micro_loss`
divides by them, so summing micro-batch losses, gradients and metrics gives the batch's mean however the batch
is split (gradient accumulation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtune import ops
from jaxtune.data.packing import IGNORE
from jaxtune.training.config import TrainConfig
from jaxtune.training.loss import chunked_cross_entropy, chunked_token_logps
from jaxtune.training.preference_loss import dpo_loss, orpo_log_odds, reward_metrics, sequence_sums

Batch = dict[str, jax.Array]


def _hidden(model, micro: Batch, rng):
    if "attention_ids" in micro:  # preference rows whose pairs run their prompt once (data/preference.py)
        with ops.shared_prefix_segments():
            return model.hidden_states(micro["input_ids"], micro["positions"], micro["attention_ids"], dropout_rng=rng)
    return model.hidden_states(micro["input_ids"], micro["positions"], micro["segment_ids"], dropout_rng=rng)


@dataclasses.dataclass(frozen=True)
class SFT:
    """Mean cross-entropy of the label tokens; for a mixture of experts whose config asks for it, plus
    `router_aux_loss_coef` times the routers' load-balancing loss (transformers' `load_balancing_loss_func`) of
    each micro-batch, averaged over the micro-batches (a batch of one micro-batch is transformers' loss)."""

    name = "sft"
    eval_weight = "tokens"
    router_aux_loss_coef: float = 0.0

    @property
    def metric_names(self) -> tuple[str, ...]:
        return ("aux_loss",) if self.router_aux_loss_coef else ()

    def weights(self, batch: Batch) -> dict[str, jax.Array]:
        weights = {"tokens": jnp.maximum(jnp.sum(batch["labels"] != IGNORE), 1).astype(jnp.float32)}
        if self.router_aux_loss_coef:
            weights["micro_batches"] = jnp.float32(batch["labels"].shape[0])
        return weights

    def micro_loss(self, graphdef, lora, frozen, micro: Batch, rng, chunk_size: int, weights) -> tuple:
        model = nnx.merge(graphdef, lora, frozen)
        if self.router_aux_loss_coef:
            hidden, aux = model.hidden_states_and_balancing_loss(micro["input_ids"], micro["positions"],
                                                                 micro["segment_ids"], dropout_rng=rng)
        else:
            hidden, aux = _hidden(model, micro, rng), None
        loss_sum, _ = chunked_cross_entropy(hidden, model.head_weight(), micro["labels"], chunk_size=chunk_size,
                                            softcap=model.config.final_logit_softcapping)
        if aux is None:
            return loss_sum / weights["tokens"], {}
        aux = aux / weights["micro_batches"]
        return loss_sum / weights["tokens"] + self.router_aux_loss_coef * aux, {"aux_loss": aux}


@dataclasses.dataclass(frozen=True)
class Preference:
    """DPO or ORPO (no reference: NLL of the chosen responses minus λ log σ(log odds ratio)).

    DPO's reference is the model as the run began: with fresh adapters (every B zero) the base model, computed
    as the same weights with the adapters at zero (no second copy of anything); with adapters trained before
    (SFT, then DPO on the same adapters) a frozen copy of those adapters, as TRL does; or log-probabilities
    computed once and carried in the batch as `ref_logps`.
    """

    name: str  # "dpo" or "orpo"
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    orpo_lambda: float = 0.1
    nll_on_prompt: bool = False  # ORPO's NLL also over the chosen prompts' tokens (TRL's ORPOTrainer does)
    eval_weight = "pairs"

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The float32 scalars `micro_loss` returns besides the loss, as TRL names them."""
        names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")
        return names + (("nll_loss", "log_odds_ratio", "log_odds_chosen") if self.name == "orpo" else ())

    def _nll_mask(self, micro: Batch) -> jax.Array:
        """Tokens of ORPO's NLL: the chosen sequences' responses (or whole sequences)."""
        chosen = (micro["segment_ids"] % 2 == 1) & (micro["labels"] != IGNORE)
        return chosen if self.nll_on_prompt else chosen & (micro["response"] > 0)

    def weights(self, batch: Batch) -> dict[str, jax.Array]:
        weights = {"pairs": jnp.maximum(jnp.sum(batch["pair_mask"]), 1).astype(jnp.float32)}
        if self.name == "orpo":
            weights["nll_tokens"] = jnp.maximum(jnp.sum(self._nll_mask(batch)), 1).astype(jnp.float32)
        return weights

    def sequence_logps(self, model, micro: Batch, rng, chunk_size: int):
        """(per-token log-probabilities [B, T], response sums (chosen, rejected) [B, P] each)."""
        token = chunked_token_logps(_hidden(model, micro, rng), model.head_weight(), micro["labels"],
                                    chunk_size=chunk_size, softcap=model.config.final_logit_softcapping)
        pairs = micro["pair_mask"].shape[-1]
        return token, sequence_sums(token * micro["response"], micro["segment_ids"], pairs)

    def micro_loss(self, graphdef, lora, frozen, micro: Batch, rng, chunk_size: int, weights) -> tuple:
        """`frozen` is the model's frozen state, or (that state, the reference's adapters) when the adapters were
        trained before this run (see `reference_adapters`)."""
        frozen, reference = frozen if isinstance(frozen, tuple) else (frozen, None)
        model = nnx.merge(graphdef, lora, frozen)
        token, (chosen, rejected) = self.sequence_logps(model, micro, rng, chunk_size)
        mask = micro["pair_mask"] > 0
        pairs = micro["pair_mask"].shape[-1]
        n_chosen, n_rejected = sequence_sums(micro["response"], micro["segment_ids"], pairs)
        per_pair = lambda x: jnp.sum(jnp.where(mask, x, 0.0)) / weights["pairs"]  # noqa: E731
        if self.name == "dpo":
            if "ref_logps" in micro:
                ref_chosen, ref_rejected = micro["ref_logps"][..., 0::2], micro["ref_logps"][..., 1::2]
            else:  # the reference: the model as the run began; fresh adapters are zero, i.e. switched off
                off = reference if reference is not None else jax.tree.map(jnp.zeros_like, jax.lax.stop_gradient(lora))
                _, (ref_chosen, ref_rejected) = self.sequence_logps(nnx.merge(graphdef, off, frozen), micro, None,
                                                                    chunk_size)
                ref_chosen, ref_rejected = jax.lax.stop_gradient(ref_chosen), jax.lax.stop_gradient(ref_rejected)
            losses = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=self.beta, loss_type=self.loss_type,
                              label_smoothing=self.label_smoothing, chosen_tokens=n_chosen,
                              rejected_tokens=n_rejected)
            rewards = self.beta * (chosen - ref_chosen), self.beta * (rejected - ref_rejected)
            metrics = reward_metrics(*jax.lax.stop_gradient(rewards), jax.lax.stop_gradient(chosen),
                                     jax.lax.stop_gradient(rejected), mask)
            return per_pair(losses), {k: v / weights["pairs"] for k, v in metrics.items()}
        # ORPO: the log-probabilities are means over each response's tokens
        chosen_mean = chosen / jnp.maximum(n_chosen, 1.0)
        rejected_mean = rejected / jnp.maximum(n_rejected, 1.0)
        log_odds = orpo_log_odds(chosen_mean, rejected_mean)
        ratio = jax.nn.log_sigmoid(log_odds)
        nll = -jnp.sum(jnp.where(self._nll_mask(micro), token, 0.0)) / weights["nll_tokens"]
        loss = nll - self.orpo_lambda * per_pair(ratio)
        stop = jax.lax.stop_gradient
        metrics = reward_metrics(stop(self.orpo_lambda * chosen_mean), stop(self.orpo_lambda * rejected_mean),
                                 stop(chosen_mean), stop(rejected_mean), mask)
        metrics = {k: v / weights["pairs"] for k, v in metrics.items()}
        metrics.update({"nll_loss": stop(nll), "log_odds_ratio": stop(per_pair(ratio)),
                        "log_odds_chosen": stop(per_pair(log_odds))})
        return loss, metrics


Objective = SFT | Preference


def make_objective(cfg: TrainConfig, router_aux_loss_coef: float = 0.0):
    """The objective of `cfg`; `router_aux_loss_coef`: the weight of a mixture of experts' load-balancing loss
    (SFT; 0 when the model's config does not ask for that loss)."""
    if cfg.objective == "sft":
        return SFT(router_aux_loss_coef)
    if cfg.objective == "grpo":
        from jaxtune.rl.loss import GRPO

        return GRPO(loss_type=cfg.loss_type, epsilon_low=cfg.epsilon,
                    epsilon_high=cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high, delta=cfg.delta,
                    beta=cfg.beta, importance_sampling_level=cfg.importance_sampling_level,
                    use_bias_correction_kl=cfg.use_bias_correction_kl,
                    max_completion_length=cfg.max_completion_length, temperature=cfg.temperature,
                    sapo_temperature_pos=cfg.sapo_temperature_pos, sapo_temperature_neg=cfg.sapo_temperature_neg,
                    vespo_k_pos=cfg.vespo_k_pos, vespo_lambda_pos=cfg.vespo_lambda_pos, vespo_k_neg=cfg.vespo_k_neg,
                    vespo_lambda_neg=cfg.vespo_lambda_neg)
    return Preference(cfg.objective, beta=cfg.beta, loss_type=cfg.dpo_loss, label_smoothing=cfg.label_smoothing,
                      orpo_lambda=cfg.orpo_lambda, nll_on_prompt=cfg.train_on_all)


def reference_adapters(lora) -> bool:
    """Whether DPO's reference needs a copy of the adapters: some B is non-zero, so the model the run starts
    from is not the base model."""
    return any(path[-1] == "lora_b" and bool(np.any(np.asarray(v))) for path, v in nnx.to_flat_state(lora))
