"""The jit-compiled training step: a pure function of (LoRA params, optimizer state, frozen weights, batch)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxtune.data.packing import IGNORE
from jaxtune.models.causal_lm import CausalLM
from jaxtune.parallel.sharding import global_batch, state_shardings
from jaxtune.training.compilation import step_compiler_options
from jaxtune.training.config import TrainConfig
from jaxtune.training.objectives import SFT, Objective, make_objective
from jaxtune.training.optimizer_offload import to_device_after, to_host

REMAT_POLICIES = {"none": "none", "selective": "selective", "recompute-experts": "selective-experts",
                  "per-layer": "full", "offload": "offload"}


# the optimizer's and schedule's numbers: arguments of the compiled step, not constants baked into it
HYPERPARAMETERS = ("learning_rate", "warmup_steps", "max_steps", "weight_decay", "adam_b1", "adam_b2", "max_grad_norm")


def step_hyperparameters(cfg: TrainConfig) -> dict[str, np.float32]:
    """`HYPERPARAMETERS` of `cfg` as float32 scalars, which the compiled step takes as an argument: runs that differ
    only in them (a learning-rate sweep, another step count or warmup) share one compiled step, from jax's
    compilation cache, instead of each compiling its own."""
    return {name: np.float32(getattr(cfg, name)) for name in HYPERPARAMETERS}


def make_schedule(cfg: TrainConfig, hyper: dict | None = None) -> optax.Schedule:
    """The learning rate at a step: linear warmup from 0 to the peak, then cosine or linear decay to 0 at max_steps
    (optax's warmup schedules), or constant. `hyper` (`step_hyperparameters`, or traced values of them) gives the
    numbers; only the schedule's kind is fixed when the step is traced."""
    h = step_hyperparameters(cfg) if hyper is None else hyper
    peak, warm, total = h["learning_rate"], h["warmup_steps"], h["max_steps"]

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        decay_steps = jnp.maximum(total - warm, 1.0)
        done = jnp.clip(count - warm, 0.0, decay_steps) / decay_steps
        if cfg.schedule == "cosine":
            after = peak * 0.5 * (1.0 + jnp.cos(jnp.pi * done))
        elif cfg.schedule == "linear":
            after = peak * (1.0 - done)
        else:
            after = peak
        return jnp.where(count < warm, peak * count / jnp.maximum(warm, 1.0), after)

    return schedule


def make_optimizer(cfg: TrainConfig, hyper: dict | None = None) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW on `make_schedule`, with `hyper`'s numbers (default: `cfg`'s). The state's
    structure does not depend on them: the state `init` makes outside the step is the one the step updates."""
    h = step_hyperparameters(cfg) if hyper is None else hyper
    return optax.chain(
        optax.clip_by_global_norm(h["max_grad_norm"]),
        optax.adamw(make_schedule(cfg, h), b1=h["adam_b1"], b2=h["adam_b2"], weight_decay=h["weight_decay"]),
    )


def split_model(model: CausalLM) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, trainable LoRA state, everything else): only the LoRA state is differentiated and donated."""
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    if not jax.tree.leaves(lora):
        raise ValueError("the model has no LoRA parameters to train; call jaxtune.get_peft_model(model) first")
    return graphdef, lora, frozen


def loss_and_grads(graphdef, lora, frozen, batch: dict[str, jax.Array], key: jax.Array | None, chunk_size: int,
                   objective: Objective | None = None):
    """(mean loss, float32 grads, metrics) over all micro-batches of batch [accum, B, ...].

    The objective divides each micro-batch's loss by counts over the WHOLE batch (label tokens, pairs), so the
    result is the same however the batch is split into micro-batches; its metrics (rewards for DPO/ORPO) are
    means over the batch the same way.
    """
    objective = objective or SFT()
    weights = objective.weights(batch)
    grad_fn = jax.value_and_grad(objective.micro_loss, argnums=1, has_aux=True)

    def accumulate(carry, xs):
        loss_acc, grad_acc, metric_acc = carry
        micro, i = xs
        rng = None if key is None else jax.random.fold_in(key, i)
        (loss, metrics), grads = grad_fn(graphdef, lora, frozen, micro, rng, chunk_size, weights)
        grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
        return (loss_acc + loss, grad_acc, jax.tree.map(jnp.add, metric_acc, metrics)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), lora)
    metric_zeros = {name: jnp.float32(0) for name in objective.metric_names}
    accum = batch["input_ids"].shape[0]
    (loss, grads, metrics), _ = jax.lax.scan(accumulate, (jnp.float32(0), zeros, metric_zeros),
                                             (batch, jnp.arange(accum)))
    return loss, grads, metrics


class OnMesh:
    """A jitted function traced and run with `mesh` set, so the ops see it (shard_map around the kernels)."""

    def __init__(self, fn: Callable, mesh: Mesh | None, batch_extra: dict[str, tuple[tuple[int, ...], Any]] | None = None,
                 trailing_args: tuple = ()):
        # batch_extra: the arrays a batch holds besides the four [accum, B, T] int32 ones, as (trailing shape,
        # dtype) each (preference pairs: response, pair_mask, ref_logps), so memory planning can build the batch;
        # trailing_args: what every call passes after the caller's arguments (the step's hyperparameters)
        self.fn, self.mesh, self.batch_extra = fn, mesh, dict(batch_extra or {})
        self.trailing_args = trailing_args

    def _ctx(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def __call__(self, *args):
        with self._ctx():
            return self.fn(*args, *self.trailing_args)

    def lower(self, *args):
        with self._ctx():
            return self.fn.lower(*args, *self.trailing_args)

    def compile(self, *args) -> Callable:
        """The function compiled ahead of time for these arguments (arrays or shape structs), called like this
        object (the trailing arguments appended); `.compiled` is XLA's executable, for its memory plan."""
        compiled = self.lower(*args).compile()
        trailing = self.trailing_args

        def call(*call_args):
            with self._ctx():
                return compiled(*call_args, *trailing)

        call.compiled = compiled
        return call


def make_train_step(graphdef: nnx.GraphDef, cfg: TrainConfig, mesh: Mesh | None = None,
                    batch_extra: dict[str, tuple[tuple[int, ...], Any]] | None = None,
                    router_aux_loss_coef: float = 0.0) -> OnMesh:
    """step(lora, opt_state, frozen, batch [accum, B, T], step) -> (lora, opt_state, metrics), with the optimizer of
    `make_optimizer(cfg)` (its state is what that optimizer's `init` makes).

    Gradient accumulation runs inside the jit (see `loss_and_grads`). A step whose loss or gradients are not
    finite leaves parameters and optimizer state unchanged (metrics["skipped"] = 1). An optional batch entry
    "stop" ([accum, B, 1], each process's rows holding its own stop request) comes back as metrics["stop"],
    its maximum over every process: all processes learn of a stop after the same step, at no extra sync.
    `router_aux_loss_coef`: a mixture of experts' load-balancing loss in the objective, with this weight (the
    graphdef's model must have `router_aux` set).
    """
    base_key = jax.random.key(cfg.seed)
    objective = make_objective(cfg, router_aux_loss_coef)

    def step(lora, opt_state, frozen, batch, step_index, hyper):
        optimizer = make_optimizer(cfg, hyper)
        batch = dict(batch)
        stop = batch.pop("stop", None)
        key = jax.random.fold_in(base_key, step_index) if cfg.lora_dropout > 0 else None
        loss, grads, objective_metrics = loss_and_grads(graphdef, lora, frozen, batch, key, cfg.ce_chunk_size,
                                                        objective)
        if cfg.offload_optimizer:
            grads, opt_state = to_device_after(opt_state, grads)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = optimizer.update(grads, opt_state, lora)
        new_lora = optax.apply_updates(lora, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": make_schedule(cfg, hyper)(step_index),
                   "tokens": jnp.sum(batch["labels"] != IGNORE), "skipped": (~finite).astype(jnp.int32),
                   "stop": jnp.int32(0) if stop is None else jnp.max(stop), **objective_metrics}
        new_lora, new_opt_state = keep(new_lora, lora), keep(new_opt_state, opt_state)
        if mesh is not None:  # params and optimizer state keep their FSDP layout from step to step
            new_lora = jax.lax.with_sharding_constraint(new_lora, state_shardings(mesh, new_lora))
            new_opt_state = jax.lax.with_sharding_constraint(new_opt_state, state_shardings(mesh, new_opt_state))
        if cfg.offload_optimizer:
            new_opt_state = to_host(new_opt_state)
        return new_lora, new_opt_state, metrics

    options = step_compiler_options(compute=cfg.compute)
    return OnMesh(jax.jit(step, donate_argnums=(0, 1), compiler_options=options), mesh, batch_extra,
                  (step_hyperparameters(cfg),))


def make_eval_step(graphdef: nnx.GraphDef, cfg: TrainConfig, mesh: Mesh | None = None) -> OnMesh:
    """eval(lora, frozen, batch [accum, B, ...]) -> (loss x weight, metrics x weight, weight): the weight is the
    batch's label tokens (SFT) or pairs (DPO/ORPO), so sums over batches give the held-out split's means."""
    objective = make_objective(cfg)

    def evaluate(lora, frozen, batch):
        weights = objective.weights(batch)
        weight = weights[objective.eval_weight]

        def body(carry, micro):
            loss, metrics = objective.micro_loss(graphdef, lora, frozen, micro, None, cfg.ce_chunk_size, weights)
            return jax.tree.map(jnp.add, carry, (loss, metrics)), None

        zeros = (jnp.float32(0), {name: jnp.float32(0) for name in objective.metric_names})
        (loss, metrics), _ = jax.lax.scan(body, zeros, batch)
        return loss * weight, jax.tree.map(lambda m: m * weight, metrics), weight

    return OnMesh(jax.jit(evaluate, compiler_options=step_compiler_options(compute=cfg.compute)), mesh)


def to_device_batch(batch: dict[str, Any], mesh: Mesh | None = None) -> dict[str, jax.Array]:
    """Host [accum, B, T] arrays to device: on a mesh, split over its batch axes (each process its own rows)."""
    if mesh is not None:
        return global_batch(mesh, batch)
    return {k: jnp.asarray(v) for k, v in batch.items()}
