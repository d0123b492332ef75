"""`jaxtune.train`: data -> packed batches -> jitted steps, with progress, metrics, eval and checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxtune.ops.dispatch import check_fp8_device
from jaxtune.parallel.distributed import (agree_min, catch_stop_signals, clear_stop_request, local_device, memory_stats,
                                 peak_memory_gib, stop_requested)
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.models.causal_lm import CausalLM
from jaxtune.qlora import get_peft_model
from jaxtune.parallel.sharding import batch_shards, make_mesh, shard_state
from jaxtune.training.batches import make_batches, prepare_data  # noqa: F401 (prepare_data: public here too)
from jaxtune.training.autobatch import (MARGIN, choose_micro_batch, refuse_if_too_large_for_host,
                                       step_bytes_or_none, too_large)
from jaxtune.training.checkpoint import RunCheckpoints, check_run_dir
from jaxtune.training.compilation import use_compilation_cache
from jaxtune.training.config import TrainConfig
from jaxtune.training.embedding_offload import embedding_to_device, embedding_to_host
from jaxtune.training.evaluation import HeldOutEval
from jaxtune.training.objectives import make_objective, reference_adapters
from jaxtune.training.optimizer_offload import place_on_host
from jaxtune.training.reference import reference_logps
from jaxtune.training.remat_choice import choose_remat
from jaxtune.training.reporting import MetricsLog, check_reporters, plot_losses
from jaxtune.training.host_memory import HostMemoryGuard, offload_plan, offloads_to_host
from jaxtune.training.step import (REMAT_POLICIES, make_eval_step, make_optimizer, make_train_step, split_model,
                                to_device_batch)

PEAK_BF16_FLOPS = 989e12  # H100/H200 dense bf16 datasheet peak, as published MFU figures use
COLLAPSE_STEPS = 3  # steps in a row with a zero gradient or a uniform-prediction loss before the run says so


class TrainingDiverged(JaxtuneError, RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclasses.dataclass
class TrainResult:
    steps: int
    losses: list[float]
    eval_losses: list[tuple[int, float]]
    packing_efficiency: float
    tokens_per_second: float
    skipped_steps: int
    interrupted: bool
    run_dir: str | None
    micro_batch_size: int
    remat: str  # the policy the run used ("auto" resolved)
    offload_optimizer: bool = False  # whether host memory held the optimizer state (set, or remat auto's last resort)
    offload_embedding: bool = False  # and the input embedding


def flops_per_token(model: CausalLM, seq_len: int) -> float:
    """LoRA training FLOPs per token: forward + input gradient of every matmul (no weight gradient for frozen
    weights) and causal attention forward + backward."""
    c = model.config
    attention = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    # a mixture of experts runs each token through its top-k experts only (plus the router); its dense layers
    # (dense_mlp_layers) through their MLP
    sparse = c.num_layers - len(c.dense_mlp_layers) if c.num_experts else 0
    expert_mlp = 3 * c.hidden_size * c.num_experts_per_tok * c.moe_intermediate_size + c.hidden_size * c.num_experts
    mlp = sparse * expert_mlp + (c.num_layers - sparse) * 3 * c.hidden_size * c.intermediate_size
    matmul = c.num_layers * attention + mlp + c.hidden_size * c.vocab_size
    return 4.0 * matmul + 6.0 * seq_len * c.head_dim * c.num_heads * c.num_layers


class _StopSignal:
    """Turns SIGINT/SIGTERM into a request the loop checks after each step (then it saves and returns)."""

    def __enter__(self):
        self._old = catch_stop_signals()
        return self

    @property
    def hit(self) -> bool:
        return stop_requested()

    def rearm(self) -> None:
        """Installs the handlers again: native libraries initialized by the first steps (GPU runtime,
        collectives) may have put their own SIGTERM handler over ours."""
        if self._old:
            catch_stop_signals()

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        clear_stop_request()


def train(
    model: CausalLM,
    tokenizer: Any,
    data: str | os.PathLike | Sequence[dict[str, Any]],
    config: TrainConfig | None = None,
    *,
    out_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: bool = True,
    callback: Callable[[dict[str, Any]], None] | None = None,
    base_model: str | None = None,
    reward_funcs: Sequence[str | Callable] | None = None,
    reward_weights: Sequence[float] | None = None,
) -> TrainResult:
    """Fine-tunes the LoRA adapters of `model` in place (adding them from `config` if it has none).

    With `out_dir`, writes metrics.jsonl, checkpoints (every `save_steps`, at the end, and on SIGINT/SIGTERM),
    config.json and loss.png there; `resume=True` continues from its latest checkpoint exactly.
    `callback(record)` sees each step's metrics record; `base_model` (default: what `from_pretrained` loaded the
    model from) is recorded in out_dir/config.json so the run can be exported later, from any directory.
    GRPO (`config.objective="grpo"`): `data` holds prompts (and the columns the rewards read), `reward_funcs` the
    reward functions (TRL's signature; callables, "FILE.py:FUNC", "last_number" or "regex:PATTERN") and
    `reward_weights` their weights (default 1 each).
    """
    base_model = base_model or getattr(model, "name_or_path", None)
    rewards = {"reward_funcs": reward_funcs, "reward_weights": reward_weights}
    try:
        return _train(model, tokenizer, data, config, out_dir, resume, progress, callback, base_model, rewards)
    finally:  # however the run ends (a refusal included), the table offload_embedding moved comes back
        embedding_to_device(model)


@dataclasses.dataclass
class _Setup:
    """What a run starts from, before any step is planned: the resolved config's request, where it writes, its
    batches, the mesh and the flags its step's graphdef carries."""

    model: CausalLM
    requested: TrainConfig  # as the caller gave it ("auto" unresolved): what config.json records
    run_dir: str | None
    lead: bool  # files beside the checkpoints are written by one process
    batches: Any  # packed dataset rows, or GRPO's scored completions
    mesh: Any
    unit: int  # micro-batches split into this many equal parts (the mesh's batch shards)
    aux_coef: float  # a mixture of experts' load-balancing loss weight (0: off)
    rows: int  # the micro-batch the step is planned for
    progress: bool
    base_model: str | None

    def split_with(self, cfg: TrainConfig, layout: tuple[int, int], quantized: str | None = None,
                   qat: bool = True):
        """The step's graphdef carries these flags; the user's model gets its defaults back. `quantized`: the
        graphdef of the held-out loss through that 4-bit format (eval_quantized), computed in the model's dtype;
        without `qat`, the plain step of the steps before qat_start_step."""
        model = self.model
        model.single_sequence_rows = self.batches.single_sequence_rows
        model.compute = "bf16" if quantized else cfg.compute
        model.offload_device_layers, model.offload_group = layout
        model.unroll_layers = cfg.unroll_layers
        model.qat = quantized or (None if cfg.qat == "none" or not qat else cfg.qat)
        model.router_aux = bool(self.aux_coef)
        try:
            return split_model(model)
        finally:
            model.single_sequence_rows, model.compute, model.offload_device_layers, model.offload_group = (
                False, "bf16", 0, 1)
            model.unroll_layers, model.qat, model.router_aux = False, None, False

    def first_layouts(self, cfg: TrainConfig, remat: str) -> tuple[Any, list[tuple[int, int]]]:
        """(host budget or None, remat "offload"'s (layers whose inputs stay on device, offload group) to try)."""
        self.model.remat_policy = REMAT_POLICIES[remat]
        if remat == "offload" and offloads_to_host():  # host memory must hold the layer inputs, in the pinned
            return offload_plan(self.model, self.rows, cfg.seq_len)  # region they make XLA's pool take
        return None, [(0, 1)]


@dataclasses.dataclass
class _Plan:
    """The planned step: the config with remat "auto" (and the offloads it may add) resolved, the step's graphdef
    and compiled functions, the layout of the layers' saved inputs, and the state the step updates."""

    cfg: TrainConfig
    graphdef: Any
    step_fn: Callable
    plain_fn: Callable  # the steps before qat_start_step (step_fn itself without QAT)
    layout: tuple[int, int]
    host: Any  # remat "offload"'s host budget, or None
    offloading: bool  # layer inputs in host memory: the loop guards host memory
    batch_extra: dict[str, Any]
    lora: Any
    frozen: Any
    opt_state: Any


def _train(model: CausalLM, tokenizer: Any, data, config: TrainConfig | None, out_dir, resume: bool, progress: bool,
           callback, base_model: str | None, rewards: dict[str, Any]) -> TrainResult:
    """The run in its phases: set up (checks, adapters, batches, mesh), plan the step (remat and the layers'
    layout), fit the card (the micro-batch, DPO's reference, the held-out evaluation), run the loop, save."""
    setup = _set_up(model, tokenizer, data, config or TrainConfig(), out_dir, resume, progress, base_model, rewards)
    plan = _plan_step(setup)
    micro, held_out = _fit_card(setup, plan)
    return _run_loop(setup, plan, micro, held_out, callback)


def _set_up(model: CausalLM, tokenizer: Any, data, cfg: TrainConfig, out_dir, resume: bool, progress: bool,
            base_model: str | None, rewards: dict[str, Any]) -> _Setup:
    """Everything refused before work is refused; the adapters, the batches and the mesh made."""
    run_dir = None if out_dir is None else os.fspath(out_dir)
    check_run_dir(run_dir, resume, cfg)
    if jax.process_index() == 0:
        check_reporters(cfg.report_to, run_dir)
    moe = model.config
    # a mixture of experts whose config asks for the routers' load-balancing loss (transformers adds it then)
    aux_coef = moe.router_aux_loss_coef if moe.num_experts and moe.output_router_logits else 0.0
    if aux_coef and cfg.objective != "sft":
        raise ConfigError(f"{moe.model_type}'s config.json asks for the routers' load-balancing loss "
                          f"(output_router_logits=true, router_aux_loss_coef={aux_coef}), which jaxtune adds to the "
                          f"SFT loss only, not to {cfg.objective}'s; set output_router_logits to false to train "
                          "without it")
    if not jax.tree.leaves(nnx.state(model, nnx.LoRAParam)):
        get_peft_model(model, r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                       target_modules=cfg.target_modules, use_rslora=cfg.use_rslora, seed=cfg.seed)
    lead = jax.process_index() == 0
    # the objective's seam: packed dataset rows, or GRPO's scored completions
    batches = make_batches(data, tokenizer, cfg, model, progress=progress, run_dir=run_dir, lead=lead, **rewards)
    mesh = make_mesh(cfg.mesh) if cfg.mesh or jax.device_count() > 1 else None
    if mesh is not None and cfg.objective == "grpo":
        batches.place_on(mesh)  # each device samples its share of a rollout
    unit = 1 if mesh is None else batch_shards(mesh)
    if cfg.compute == "fp8":
        check_fp8_device()
    use_compilation_cache(cfg.compile_cache)
    rows = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else unit
    return _Setup(model, cfg, run_dir, lead, batches, mesh, unit, aux_coef, rows, progress, base_model)


def _plan_step(setup: _Setup) -> _Plan:
    """The remat policy ("auto": the fastest whose step fits, host offloads as the last resort) and the layout of
    the layers' saved inputs, each candidate step compiled once; the state placed as the plan needs it."""
    model, cfg, mesh, aux_coef = setup.model, setup.requested, setup.mesh, setup.aux_coef
    lora, frozen = nnx.state(model, nnx.LoRAParam, ...)  # the states split_model gives, whatever the policy
    with_reference = (cfg.objective == "dpo" and not cfg.precompute_reference) or (cfg.objective == "grpo"
                                                                                    and cfg.beta > 0)
    if with_reference and reference_adapters(lora):
        frozen = (frozen, jax.tree.map(jnp.copy, lora))  # DPO's / GRPO's reference: the adapters as the run begins
    # arrays a batch holds besides the token ones (preference pairs), so the step can be planned before data flows
    batch_extra = dict(setup.batches.batch_extra)
    if cfg.precompute_reference:
        batch_extra["ref_logps"] = ((2 * setup.batches.train_rows.extra["pair_mask"].shape[1],), np.dtype(np.float32))
    opt_state = make_optimizer(cfg).init(lora)
    if mesh is not None:
        lora, frozen, opt_state = (shard_state(mesh, tree) for tree in (lora, frozen, opt_state))
    opt_state, frozen = _to_host_memory(model, opt_state, frozen, cfg.offload_optimizer, cfg.offload_embedding)
    tried = {}  # remat "auto": each candidate's (graphdef, step), the step compiled once to plan it (jit reuses it)
    if cfg.remat == "auto":
        def build_step(remat: str):
            candidate = dataclasses.replace(cfg, remat=remat)
            graphdef = setup.split_with(candidate, setup.first_layouts(candidate, remat)[1][0])[0]
            step = make_train_step(graphdef, candidate, mesh, batch_extra, aux_coef)
            tried[remat] = graphdef, step
            return step

        choice = choose_remat(build_step, lora, opt_state, frozen, setup.rows, cfg, offloads_to_host(),
                              experts=bool(model.config.num_experts))
        if setup.lead:
            print(choice.reason, flush=True)
        cfg = dataclasses.replace(cfg, remat=choice.policy)
        if choice.policy == "offload" and not choice.fits:  # the last resort: host memory takes what else it can
            more = {"offload_optimizer": not cfg.offload_optimizer,
                    "offload_embedding": not cfg.offload_embedding and model.lm_head is not None}
            if any(more.values()):
                opt_state, frozen = _to_host_memory(model, opt_state, frozen, *more.values())
                cfg = dataclasses.replace(cfg, **{k: True for k, v in more.items() if v})
                tried.pop("offload")  # its step kept those arrays on the device
                if setup.lead:
                    moved = [f"{_HOST_OFFLOADS[k]} ({k})" for k, v in more.items() if v]
                    print(f"remat auto: {' and '.join(moved)} also kept in host memory", flush=True)
    host, layouts = setup.first_layouts(cfg, cfg.remat)
    if cfg.remat in tried:
        graphdef, step_fn = tried[cfg.remat]
    else:
        graphdef = setup.split_with(cfg, layouts[0])[0]
        step_fn = make_train_step(graphdef, cfg, mesh, batch_extra, aux_coef)
    layout = layouts[0]
    if len(layouts) > 1 and not _fits_device(step_fn, lora, opt_state, frozen, cfg, setup.unit):
        layout = layouts[1]
        step_fn = make_train_step(setup.split_with(cfg, layout)[0], cfg, mesh, batch_extra, aux_coef)
    on_device, group = layout
    # QAT from qat_start_step on: the steps before it are plain LoRA's (planned with the QAT step, the larger)
    plain_fn = (make_train_step(setup.split_with(cfg, layout, qat=False)[0], cfg, mesh, batch_extra, aux_coef)
                if cfg.qat_start_step else step_fn)
    if on_device and setup.lead:
        print(f"remat offload: the inputs of {on_device} of {model.config.num_layers} layers stay in device memory, "
              f"host memory holds the rest ({host.describe()})", flush=True)
    if group > 1 and setup.lead:
        print(f"remat offload: host memory holds the input of one layer in {group}; the layers between are "
              f"recomputed from it (one more forward each; {host.describe()})", flush=True)
    offloading = cfg.remat == "offload" and offloads_to_host()
    return _Plan(cfg, graphdef, step_fn, plain_fn, layout, host, offloading, batch_extra, lora, frozen, opt_state)


def _fit_card(setup: _Setup, plan: _Plan) -> tuple[int, HeldOutEval | None]:
    """(the micro-batch: the largest that fits when "auto", refused in one line when too large; the held-out
    evaluation or None), with DPO's reference log-probabilities computed first when asked and the batches started."""
    cfg, batches, mesh, unit = plan.cfg, setup.batches, setup.mesh, setup.unit
    if cfg.micro_batch_size == "auto":
        micro = choose_micro_batch(cfg, plan.step_fn, plan.lora, plan.opt_state, plan.frozen, rows=len(batches))
        if cfg.objective == "grpo":  # whole groups per step: the largest that fits and keeps them whole
            micro = _whole_groups(micro, cfg.grad_accum, cfg.num_generations, unit)
        if setup.lead:
            print(f"micro_batch_size auto: {micro} (device memory, and the {len(batches)} rows the dataset packs "
                  "into, allow it)", flush=True)
    else:
        micro = cfg.micro_batch_size
    refuse_if_too_large_for_host(plan.step_fn, plan.lora, plan.opt_state, plan.frozen, micro, cfg)
    if micro % unit:
        raise JaxtuneError(f"micro_batch_size {micro} does not split over the {unit} devices of mesh "
                           f"{dict(mesh.shape)}; use a multiple of {unit}")
    eval_rows = getattr(batches, "eval_rows", None)
    if cfg.precompute_reference:  # DPO: the reference's log-probabilities once, stored with the run
        splits = {"train": batches.train_rows, **({"eval": eval_rows} if eval_rows is not None else {})}
        if setup.run_dir is not None and setup.lead:
            os.makedirs(setup.run_dir, exist_ok=True)
        refs = reference_logps(plan.graphdef, plan.lora, plan.frozen, splits, micro, cfg, setup.run_dir, mesh,
                               setup.lead, setup.progress)
        for name, rows_of in splits.items():
            rows_of.extra["ref_logps"] = refs[name]
    batches.start(micro, cfg.grad_accum)  # its micro_batch / accum: halved and doubled on running out of memory
    if eval_rows is None or not len(eval_rows):
        return micro, None
    quantized = None if cfg.eval_quantized == "none" else cfg.eval_quantized
    # under QAT of that format, the run's own evaluation already is the quantized one
    quantized_fn = None if quantized in (None, cfg.qat) else make_eval_step(
        setup.split_with(cfg, plan.layout, quantized)[0], dataclasses.replace(cfg, compute="bf16"), mesh)
    return micro, HeldOutEval(make_eval_step(plan.graphdef, cfg, mesh), eval_rows, quantized, quantized_fn)


def _run_loop(setup: _Setup, plan: _Plan, micro: int, held_out: HeldOutEval | None, callback) -> TrainResult:
    """The steps from the latest checkpoint (or the first) to max_steps, with the progress bar, metrics, evaluation,
    checkpoints and the stop signals; then the last save and the loss plot."""
    model, cfg, requested, batches, mesh, lead = setup.model, plan.cfg, setup.requested, setup.batches, setup.mesh, \
        setup.lead
    run_dir, lora, frozen, opt_state = setup.run_dir, plan.lora, plan.frozen, plan.opt_state
    # what "auto" resolved to: the remat policy, and whether host memory also holds the optimizer state and the
    # input embedding
    resolved = {"remat": cfg.remat, "offload_optimizer": cfg.offload_optimizer,
                "offload_embedding": cfg.offload_embedding}
    ckpt, start_step, skipped_total, losses, eval_losses = None, 0, 0, [], []
    if run_dir is not None:
        os.makedirs(run_dir, exist_ok=True)
        ckpt = RunCheckpoints(run_dir)
        latest = ckpt.latest_step()  # check_run_dir refused checkpoints without resume
        if latest is not None:
            lora, opt_state, meta = ckpt.restore(lora, opt_state)  # into the live arrays' memory (host, offloaded)
            batches.restore(meta["data"])
            start_step, skipped_total = int(meta["step"]), int(meta["skipped"])
            losses, eval_losses = list(meta["losses"]), [tuple(e) for e in meta["eval_losses"]]
        if lead:
            with open(os.path.join(run_dir, "config.json"), "w") as f:
                json.dump({"train": requested.to_dict(), "model": model.config.to_hf(), "micro_batch_size": micro,
                           **resolved, "base_model": setup.base_model}, f, indent=2)
    hparams = {**requested.to_dict(), "micro_batch_size": micro, **resolved}
    metrics = MetricsLog(run_dir, cfg.report_to, hparams, start_step) if lead else None

    def save(step: int) -> None:
        if ckpt is not None:
            meta = {"step": step, "skipped": skipped_total, "data": batches.state(), "losses": losses,
                    "eval_losses": [list(e) for e in eval_losses]}
            ckpt.save(step, lora, opt_state, meta)

    fpt = flops_per_token(model, cfg.seq_len)
    on_gpu = local_device().platform == "gpu"
    agreed_stop = jax.process_count() > 1  # every process stops after the same step: the flag rides in the step
    uniform_loss = math.log(model.config.vocab_size)
    # DPO/ORPO: rewards and log-probabilities, as TRL names them; a mixture of experts' aux_loss
    objective_metrics = make_objective(cfg, setup.aux_coef).metric_names
    step, bad_in_row, collapsed_in_row, interrupted, tokens_per_s = start_step, 0, 0, False, 0.0
    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="training", unit="step", disable=not setup.progress)
    try:
        with _StopSignal() as stop, (HostMemoryGuard() if plan.offloading else contextlib.nullcontext()):
            while step < cfg.max_steps:
                t0 = time.perf_counter()
                stop.rearm()
                host_batch = dict(batches.next(lora, frozen, step))
                host_batch["stop"] = np.full((batches.accum, batches.micro_batch, 1), int(stop.hit), np.int32)
                while True:
                    batch = to_device_batch({k: v.reshape(batches.accum, batches.micro_batch, -1)
                                             for k, v in host_batch.items()}, mesh)
                    try:
                        fn = plan.plain_fn if step < cfg.qat_start_step else plan.step_fn
                        new_lora, new_opt_state, m = fn(lora, opt_state, frozen, batch, np.int32(step))
                        m = jax.device_get(m)  # a launch that runs out of memory may fail only here (asynchronously)
                        lora, opt_state = new_lora, new_opt_state
                        break
                    except Exception as e:  # noqa: BLE001 (only out-of-memory is handled)
                        if not _can_step_down(e, batches, lora, setup.unit):
                            if "RESOURCE_EXHAUSTED" in str(e):
                                raise _out_of_memory(plan.step_fn, lora, opt_state, frozen, batches.micro_batch,
                                                     cfg) from None
                            raise
                        batches.micro_batch, batches.accum = batches.micro_batch // 2, batches.accum * 2
                        warnings.warn(f"out of device memory: micro-batch lowered to {batches.micro_batch} "
                                      f"(gradient accumulation {batches.accum}, same tokens per step)", stacklevel=2)
                m = {k: float(v) for k, v in m.items()}
                dt = time.perf_counter() - t0
                step += 1
                tokens_per_s = float((host_batch["segment_ids"] > 0).sum()) / dt
                bad_in_row = bad_in_row + 1 if m["skipped"] else 0
                skipped_total += int(m["skipped"])
                losses.append(m["loss"])
                record = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                          "tokens_per_s": round(tokens_per_s, 1), "skipped": int(m["skipped"])}
                record.update({k: m[k] for k in objective_metrics})
                record.update(batches.metrics)
                if on_gpu:
                    record["mfu"] = round(tokens_per_s * fpt / PEAK_BF16_FLOPS, 4)
                    record["peak_memory_gib"] = peak_memory_gib()
                # (GRPO's gradient is zero, rightly, when every group's completions scored alike)
                collapsed = (m["grad_norm"] == 0.0 and cfg.objective != "grpo") or (
                    cfg.objective == "sft" and abs(m["loss"] - uniform_loss) < 1e-4 * uniform_loss)
                collapsed_in_row = collapsed_in_row + 1 if collapsed else 0
                if collapsed_in_row >= COLLAPSE_STEPS:
                    record["collapsed"] = 1
                    if collapsed_in_row == COLLAPSE_STEPS:
                        warnings.warn(
                            f"training has collapsed: {COLLAPSE_STEPS} steps in a row (to step {step}) with a zero "
                            f"gradient norm or the loss of uniform predictions (log vocab = {uniform_loss:.3f}); the "
                            "model is learning nothing: lower learning_rate", stacklevel=2)
                if held_out is not None and (step == cfg.max_steps or (cfg.eval_steps and step % cfg.eval_steps == 0)):
                    record.update(held_out.record(lora, frozen, micro, mesh))
                    eval_losses.append((step, record["eval_loss"]))
                if metrics is not None and (step % cfg.logging_steps == 0 or "eval_loss" in record
                                            or step == cfg.max_steps):
                    metrics.write(record)
                if callback is not None:
                    callback(record)
                shown = {"reward": f"{record['reward']:.3f}"} if "reward" in record else {}
                bar.set_postfix(loss=f"{m['loss']:.4f}", **shown, tok_s=f"{tokens_per_s:,.0f}")
                bar.update(1)
                if bad_in_row >= cfg.max_bad_steps:
                    bar.close()
                    raise TrainingDiverged(
                        f"{bad_in_row} steps in a row had a non-finite loss or gradient (step {step}); stopped with the "
                        "last good checkpoint intact: lower learning_rate or check the data"
                    )
                if cfg.save_steps and step % cfg.save_steps == 0:
                    save(step)
                if (m["stop"] if agreed_stop else stop.hit):
                    interrupted = True
                    break
    finally:
        nnx.update(model, lora)  # the donated originals are gone: the model always holds the live params
        if metrics is not None:
            metrics.close()
    bar.close()
    save(step)
    if ckpt is not None:
        ckpt.close()
    if run_dir is not None and losses and lead:
        plot_losses(os.path.join(run_dir, "loss.png"), losses, eval_losses)
    return TrainResult(step, losses, eval_losses, batches.efficiency, tokens_per_s, skipped_total, interrupted,
                       run_dir, batches.micro_batch, cfg.remat, cfg.offload_optimizer, cfg.offload_embedding)


_HOST_OFFLOADS = {"offload_optimizer": "the optimizer state", "offload_embedding": "the input embedding"}


def _to_host_memory(model: CausalLM, opt_state, frozen, optimizer: bool, embedding: bool):
    """(opt_state, frozen) with the optimizer state and/or the input embedding in pinned host memory; the model
    holds the embedding's host copy until `train` ends."""
    if optimizer:
        opt_state = place_on_host(opt_state)
    if embedding:
        frozen = embedding_to_host(model, frozen)
    return opt_state, frozen


def _whole_groups(micro: int, accum: int, generations: int, unit: int = 1) -> int:
    """The largest micro-batch <= `micro` whose step (x `accum`) holds whole groups of `generations` completions
    and that splits over the `unit` devices of the mesh."""
    fitting = [m for m in range(micro, 0, -1) if (m * accum) % generations == 0 and m % unit == 0]
    if not fitting:
        raise JaxtuneError(f"micro_batch_size auto found {micro} completions per micro-batch fit, but no micro-batch up "
                           f"to that times grad_accum {accum} is a multiple of num_generations {generations}; raise "
                           f"grad_accum (e.g. {generations}) or lower num_generations")
    return fitting[0]


def _fits_device(step_fn, lora, opt_state, frozen, cfg: TrainConfig, unit: int) -> bool:
    """Whether the compiled step fits device memory with autobatch's margin (true where the size is unknown), the
    same answer on every process."""
    bytes_limit = memory_stats().get("bytes_limit")
    if bytes_limit is None:
        return True
    micro = cfg.micro_batch_size if isinstance(cfg.micro_batch_size, int) else unit
    need = step_bytes_or_none(step_fn, lora, opt_state, frozen, micro, cfg)
    fits = need is not None and need <= MARGIN * bytes_limit
    return bool(agree_min(int(fits)))


def _out_of_memory(step_fn, lora, opt_state, frozen, micro: int, cfg: TrainConfig) -> JaxtuneError:
    """A first step that ran out of device memory at a batch that cannot shrink, as the one-line refusal with
    what the step needs (its compiled size, planned from the arguments' shapes: the donated ones may be gone) and
    what the device has."""
    need = step_bytes_or_none(step_fn, lora, opt_state, frozen, micro, cfg)
    return too_large(cfg, micro, need, memory_stats().get("bytes_limit") or 0, "the device")


def _can_step_down(error: Exception, batches, lora, unit: int = 1) -> bool:
    """An out-of-memory failure that left the (donated) params intact, at a micro-batch that can halve and
    still split into `unit` equal parts (the devices of the mesh)."""
    return ("RESOURCE_EXHAUSTED" in str(error) and batches.micro_batch % (2 * unit) == 0
            and not any(x.is_deleted() for x in jax.tree.leaves(lora)))
