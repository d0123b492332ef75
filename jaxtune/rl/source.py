"""GRPO's batches: each step's prompts sampled num_generations times from the current policy, scored by the reward
functions, normalized into advantages; with the metrics and a sample of completions for the run directory."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.multihost_utils import process_allgather

from jaxtune.data import BatchStream, PackedRows
from jaxtune.data.sources import Row
from jaxtune.parallel.distributed import agree_min, agree_on_checks, memory_stats
from jaxtune.generate import eos_token_ids, per_layer_cache, prompt_bucket
from jaxtune.platform.host_info import GIB
from jaxtune.rl.advantages import _nanstd, group_advantages
from jaxtune.rl.loss import GRPO
from jaxtune.rl.rewards import RewardError, RewardFunction, RewardLogs, TrainerState, score
from jaxtune.rl import rollout as rollout_module
from jaxtune.rl import decode_bound
from jaxtune.rl.rollout import completion_lists, rollout_rows, rows_per_call, sample_rollout, sampling_bytes
from jaxtune.parallel.sharding import batch_shards, global_rows
from jaxtune.training.autobatch import MARGIN, StepTooLarge

SAMPLES_PER_LOG = 8  # completions written to completions.jsonl at each logging step


def _prompt_index(n: int) -> PackedRows:
    """Rows that are only the prompts' indices, so BatchStream orders them (seeded epochs, saved position)."""
    index = np.arange(n, dtype=np.int32)[:, None]
    return PackedRows(index, index, index, index, 0)


class Rollouts:
    """The step's batches for objective "grpo": `next(lora, frozen, step)` samples and scores a batch every
    num_iterations steps (the steps between reuse it, with the sampling policy's log-probabilities for the
    ratio); `metrics` holds the last batch's reward and completion metrics under TRL's names."""

    ignore_eos = False  # benchmarks set it: every completion runs max_completion_length tokens

    def __init__(self, rows: Sequence[Row], prompt_ids: list[list[int]], tokenizer: Any, model, cfg,
                 funcs: Sequence[RewardFunction], weights: np.ndarray, run_dir: str | None, lead: bool):
        self.rows, self.prompt_ids, self.tokenizer, self.cfg = list(rows), prompt_ids, tokenizer, cfg
        self.funcs, self.weights = list(funcs), weights
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.sampler_graphdef = nnx.split(model, nnx.LoRAParam, ...)[0]  # the inference flags, no remat
        self.num_layers = model.config.num_layers
        self.model_config, self.model_dtype = model.config, model.dtype
        # every rollout's prompts padded for the longest of the run: one compiled sampler serves every step
        self.longest_prompt = max(map(len, prompt_ids)) if prompt_ids else 0
        self._step_bytes: dict[tuple, int] = {}  # a decoding step's bytes by (rows, cache length, per layer, dense)
        self.samples_path = os.path.join(run_dir, "completions.jsonl") if run_dir is not None and lead else None
        self.batch_extra = {"advantages": ((1,), np.dtype(np.float32))}
        if cfg.num_iterations > 1:
            self.batch_extra["old_logps"] = ((cfg.seq_len,), np.dtype(np.float32))
        self.single_sequence_rows, self.efficiency = True, 0.0
        self.metrics: dict[str, float] = {}
        self.stream: BatchStream | None = None
        self.lead = lead
        self.rows_per_call: int | None = None  # sampling calls' rows (None: a step's completions in one call)
        self._planned = False
        self._needs: dict[tuple[int, int, int], int] = {}  # sampling plans' bytes by (rows, prompt length, dense)
        self.dense = 0  # decoder layers sampled from the base dequantized once per rollout, -1 all (`_plan_sampling`)
        self._cached: dict[str, np.ndarray] | None = None
        self._logps_fns: dict = {}  # jitted per QAT format (qat_start_step switches it)
        self.mesh = None  # set by place_on: sampling and the ratio's log-probabilities split over its devices
        self.tokens_seen = 0  # prompt + completion tokens sampled so far (TRL's num_tokens), saved with the run

    def place_on(self, mesh) -> None:
        """Sample on `mesh` (each device its share of a rollout's rows, as the step splits a micro-batch)."""
        self.mesh = mesh

    def __len__(self) -> int:
        """Completions one pass over the prompts makes (what auto batch may fill)."""
        return len(self.rows) * self.cfg.num_generations

    def start(self, micro_batch: int, accum: int) -> None:
        per_step = micro_batch * accum
        if per_step % self.cfg.num_generations:
            from jaxtune.errors import ConfigError

            raise ConfigError(f"micro_batch_size x grad_accum = {per_step} completions per step is not a multiple "
                              f"of num_generations {self.cfg.num_generations}", field="micro_batch_size")
        self.micro_batch, self.accum = micro_batch, accum
        self.stream = BatchStream(_prompt_index(len(self.rows)), micro_batch=per_step // self.cfg.num_generations,
                                  accum=1, seed=self.cfg.seed)

    def state(self) -> dict[str, Any]:
        return {**self.stream.state(), "tokens_seen": self.tokens_seen}

    def restore(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.tokens_seen = int(state.pop("tokens_seen", 0))
        self.stream.restore(state)

    def next(self, lora, frozen, step: int) -> dict[str, np.ndarray]:
        """The step's host batch {input_ids, labels, segment_ids, positions, advantages[, old_logps]} [rows, ...]."""
        if self._cached is not None and step % self.cfg.num_iterations:
            return self._cached
        cfg, g = self.cfg, self.cfg.num_generations
        t0 = time.perf_counter()
        take = self.stream.next()["input_ids"].reshape(-1)
        prompt_rows = [self.rows[i] for i in take for _ in range(g)]  # each prompt's group consecutive
        prompt_ids = [self.prompt_ids[i] for i in take for _ in range(g)]
        key = jax.random.fold_in(jax.random.key(cfg.seed), step)
        frozen = frozen[0] if isinstance(frozen, tuple) else frozen
        if not self._planned:
            self.rows_per_call, self._planned = self._plan_sampling(lora, frozen, len(prompt_ids)), True
        out, decoded = sample_rollout(self.sampler_graphdef, lora, frozen, prompt_ids, key, pad_id=self.pad_id,
                                      rows_per_call=self.rows_per_call, mesh=self.mesh, dense=self.dense,
                                      continuous=True, longest_prompt=self.longest_prompt,
                                      **self._sampling_options())
        completions = completion_lists(out)
        t1 = time.perf_counter()
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        prompts = [r.data["prompt"] for r in prompt_rows]
        if not isinstance(prompts[0], str):  # conversational: completions as assistant messages, as TRL passes them
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        columns = {k: [r.data.get(k) for r in prompt_rows] for k in prompt_rows[0].data if k != "prompt"}
        self.tokens_seen += sum(map(len, prompt_ids)) + sum(map(len, completions))
        logs = RewardLogs()
        extras = {"trainer_state": TrainerState(
            global_step=step, max_steps=cfg.max_steps, epoch=step * len(take) / len(self.rows),
            num_input_tokens_seen=self.tokens_seen, logging_steps=cfg.logging_steps, save_steps=cfg.save_steps,
            is_world_process_zero=self.lead), "log_extra": logs.log_extra, "log_metric": logs.log_metric}
        rewards = self._score(prompts, texts, completions, columns, [r.where for r in prompt_rows], step, extras)
        advantages, reward_metrics = group_advantages(rewards, self.weights, g, cfg.scale_rewards,
                                                      cfg.multi_objective_aggregation)
        batch, truncated = rollout_rows(prompt_ids, completions, cfg.seq_len, self.eos_ids,
                                        cfg.mask_truncated_completions)
        batch["advantages"] = advantages[:, None]
        if cfg.num_iterations > 1:  # the sampling policy's log-probabilities, for the ratio on the later steps
            batch["old_logps"] = self._old_logps(lora, frozen, batch, step)
        self.efficiency = float((batch["segment_ids"] > 0).mean())
        self.metrics = self._metrics(completions, truncated, rewards, reward_metrics, t1 - t0,
                                     time.perf_counter() - t1)
        self.metrics.update(self._decode_metrics(lora, frozen, decoded, self.longest_prompt, t1 - t0))
        self.metrics.update(logs.metric_means())
        self._cached = batch
        if self.samples_path is not None and step % cfg.logging_steps == 0:
            self._write_samples(step + 1, prompts, texts, rewards, advantages, logs.extra)
        return batch

    def _score(self, prompts: list, texts: list, completions: list[list[int]], columns: dict[str, list],
               where: list[str], step: int, extras: dict[str, Any]) -> np.ndarray:
        """Rewards [completions, functions]. Across processes each scores its own share of the rollout (a reward
        function with a cost or a side effect, a verifier or a sandbox, runs once per completion) and all gather
        the whole; a reward function failing on one process ends every process, each with a line naming it."""
        n, p = jax.process_count(), jax.process_index()
        if n == 1:
            return score(self.funcs, prompts, texts, completions, columns, where, extras)
        part = slice(p * len(texts) // n, (p + 1) * len(texts) // n)  # whole micro-batch rows: len % n == 0
        local, error = None, None
        try:
            local = score(self.funcs, prompts[part], texts[part], completions[part],
                          {k: v[part] for k, v in columns.items()}, where[part], extras)
        except RewardError as e:
            error = e
        agree_on_checks(error, stage=f"rewards/{step}", failed="failed scoring its share of the rollout")
        return np.asarray(process_allgather(local, tiled=True))

    def _sampling_options(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature, top_p=cfg.top_p,
                    top_k=cfg.top_k, eos_ids=self.eos_ids, ignore_eos=self.ignore_eos)

    def _plan_sampling(self, lora, frozen, total: int) -> int | None:
        """Rows per sampling call: a step's completions at once when their KV cache and prefill fit the device beside
        what it holds (the training step's temporaries are freed by then), else the largest even split that fits.
        None on CPU (host memory: one call). First choice on one device with per-layer caches: the base dequantized
        once per rollout (`self.dense`), every layer's where that fits at once, else the most leading layers' that
        fit beside the codes' sampler; `rollout.DENSE_ROLLOUT` forces it on or off."""
        choice = rollout_module.DENSE_ROLLOUT
        # one device: on a mesh the codes' shards would each be dequantized whole (not measured there yet)
        wanted = choice is not False and self.mesh is None and per_layer_cache(jax.default_backend() == "gpu")
        stats = memory_stats()
        if stats.get("bytes_limit") is None:
            self.dense = -1 if wanted and choice is True else 0
            return None
        held = stats.get("bytes_in_use", 0)
        free = MARGIN * stats["bytes_limit"] - held
        prompt_len = max(len(p) for p in self.prompt_ids)
        if wanted:
            self.dense = self._dense_layers(lora, frozen, total, prompt_len, free, forced=choice is True)
            if self.dense:
                return None
        needs: dict[int, int] = {}

        def fits(rows: int) -> bool:
            needs[rows] = self._sampling_need(lora, frozen, rows, prompt_len)
            return needs[rows] <= free

        # every process samples in the same calls (on a mesh spanning processes each call is collective)
        rows = agree_min(rows_per_call(total, fits, 1 if self.mesh is None else batch_shards(self.mesh)) or 0) or None
        if rows is None:
            least = min(needs)  # one completion per device (this process's need; another's may be what failed)
            what = "one completion" if least == 1 else f"{least} completions (one per device)"
            raise StepTooLarge(
                f"sampling {what} of up to {self.cfg.max_completion_length} tokens after a {prompt_len}-token "
                f"prompt needs {needs[least] / GIB:,.1f} GiB beside the {held / GIB:,.1f} GiB the model and optimizer "
                f"hold, over the {MARGIN * stats['bytes_limit'] / GIB:,.1f} GiB the device has to use; lower "
                "--max-completion-length or shorten the prompts")
        if rows < total and self.lead:
            how = (f"{rows} completions per call, {total // rows} calls per rollout" if self.mesh is not None else
                   f"{rows} slots of continuous batching, each refilled as its completion ends")
            print(f"sampling: {how} (all {total} at once need {needs[total] / GIB:,.1f} GiB; the device has "
                  f"{free / GIB:,.1f} GiB free)")
        return None if rows == total else rows

    def _sampling_need(self, lora, frozen, rows: int, prompt_len: int, dense: int = 0) -> int:
        """`rollout.sampling_bytes` of one sampling call, each plan compiled once per planning."""
        key = (rows, prompt_len, dense)
        if key not in self._needs:
            self._needs[key] = sampling_bytes(self.sampler_graphdef, lora, frozen, rows, prompt_len, mesh=self.mesh,
                                              dense=dense, **self._sampling_options())
        return self._needs[key]

    def _dense_layers(self, lora, frozen, rows: int, prompt_len: int, free: float, forced: bool) -> int:
        """How many leading decoder layers a rollout of `rows` completions reads from a dequantized copy: -1 (all)
        where XLA's plan of that sampler fits in `free` bytes (or `forced`), else the most whose plan fits beside
        the codes' (each layer's copy costs the same; the estimate is checked against the plan), else 0."""
        def need(dense: int) -> int:
            return self._sampling_need(lora, frozen, rows, prompt_len, dense)

        if forced:
            return -1
        whole = need(-1)
        if whole <= free:
            return -1
        layers = self.num_layers
        codes = need(0)
        per_layer = max(1, (whole - codes) // layers)
        count = min(layers - 1, int((free - codes) // per_layer)) if free > codes else 0
        while count > 0 and need(count) > free:
            count -= max(1, count // 4)
        if count > 0 and self.lead:
            print(f"sampling: {count} of {layers} decoder layers from a dequantized copy, the rest from the 4-bit "
                  f"codes (all of them need {whole / GIB:,.1f} GiB; the device has {free / GIB:,.1f} GiB free)")
        return max(count, 0)

    def _old_logps(self, lora, frozen, batch: dict[str, np.ndarray], step: int) -> np.ndarray:
        """The batch's log-probabilities under the adapters that sampled it, by the step's own forward (its FP8
        projections, QAT's rounding from qat_start_step on), as TRL computes them with the model it trains: a
        batch's first step then has ratio 1."""
        cfg = self.cfg
        qat = None if cfg.qat == "none" or step < cfg.qat_start_step else cfg.qat
        if qat not in self._logps_fns:
            objective, graphdef = GRPO(temperature=cfg.temperature), self.sampler_graphdef

            @jax.jit
            def logps(lora, frozen, micro):
                frozen = frozen[0] if isinstance(frozen, tuple) else frozen
                model = nnx.merge(graphdef, lora, frozen)
                model.compute, model.qat = cfg.compute, qat
                return objective.token_logps(model, micro, cfg.ce_chunk_size)[0]

            self._logps_fns[qat] = logps
        logps_fn = self._logps_fns[qat]
        keys = ("input_ids", "labels", "segment_ids", "positions")
        out = []
        for s in range(0, len(batch["input_ids"]), self.micro_batch):
            micro = {k: batch[k][s:s + self.micro_batch] for k in keys}
            if self.mesh is None:
                out.append(np.asarray(logps_fn(lora, frozen, {k: jnp.asarray(v) for k, v in micro.items()})))
                continue
            with jax.set_mesh(self.mesh):
                logps = logps_fn(lora, frozen, {k: global_rows(self.mesh, v) for k, v in micro.items()})
            out.append(np.asarray(process_allgather(logps, tiled=True)))
        return np.concatenate(out).astype(np.float32)

    def _metrics(self, completions: list[list[int]], truncated: np.ndarray, rewards: np.ndarray,
                 reward_metrics: dict[str, float], generate_s: float, score_s: float) -> dict[str, float]:
        lengths = np.array([len(c) for c in completions], np.float32)
        done = lengths[~truncated]
        m = dict(reward_metrics)
        for j, f in enumerate(self.funcs):
            with np.errstate(invalid="ignore"):
                m[f"rewards/{f.name}/mean"] = float(np.nanmean(rewards[:, j]))
                m[f"rewards/{f.name}/std"] = float(_nanstd(rewards[:, j]))
        m.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                  "completions/max_length": float(lengths.max()),
                  "completions/clipped_ratio": float(truncated.mean()),
                  "completions/mean_terminated_length": float(done.mean()) if done.size else 0.0,
                  "completions/min_terminated_length": float(done.min()) if done.size else 0.0,
                  "completions/max_terminated_length": float(done.max()) if done.size else 0.0,
                  "num_tokens": float(self.tokens_seen),
                  "rollout_seconds": round(generate_s, 3), "reward_seconds": round(score_s, 3),
                  "generated_tokens": float(lengths.sum())})
        return m

    def _decode_metrics(self, lora, frozen, decoded, prompt_len: int, seconds: float) -> dict[str, float]:
        """The rollout's decoding: steps, refill prefills, and (on a GPU whose bandwidth is known) the fraction of
        the memory-bandwidth bound its time reached: every step reads the weights and the cache once."""
        m = {"rollout/decode_steps": float(decoded.steps), "rollout/prefills": float(decoded.prefills),
             "rollout/slots": float(decoded.rows),
             "rollout/tokens_per_second": round(self.metrics["generated_tokens"] / max(seconds, 1e-9), 1)}
        bandwidth = decode_bound.memory_bandwidth()
        if bandwidth is None or self.mesh is not None:
            return m
        options = rollout_module.sampler_options(self.cfg.max_completion_length, prompt_bucket(prompt_len),
                                          self.cfg.temperature, self.cfg.top_p, self.cfg.top_k, self.eos_ids,
                                          self.ignore_eos, self.dense)
        shape = (decoded.rows, options["cache_len"], options["per_layer"], options["dense"])
        if shape not in self._step_bytes:  # the same every rollout of that shape
            dense = 1.0 if options["dense"] < 0 else options["dense"] / self.num_layers
            self._step_bytes[shape] = decode_bound.step_bytes(frozen, lora, self.model_config, self.model_dtype,
                                                              *shape[:3], dense)
        step_bytes = self._step_bytes[shape]
        m["rollout/step_bytes"] = float(step_bytes)
        m["rollout/hbm_bound_fraction"] = round(
            decode_bound.bound_seconds(decoded.steps, step_bytes, bandwidth) / max(seconds, 1e-9), 4)
        return m

    def _write_samples(self, step: int, prompts: list, texts: list, rewards: np.ndarray,
                       advantages: np.ndarray, extra: dict[str, list]) -> None:
        """The first completions of the rollout with their rewards, advantage and the columns reward functions
        logged with log_extra (a value that is not JSON written as its text)."""
        with open(self.samples_path, "a") as f:
            for i in range(min(SAMPLES_PER_LOG, len(texts))):
                scores = {fn.name: (None if np.isnan(rewards[i, j]) else float(rewards[i, j]))
                          for j, fn in enumerate(self.funcs)}
                sample = {"step": step, "prompt": prompts[i], "completion": texts[i], "rewards": scores,
                          "advantage": float(advantages[i])}
                if extra:
                    sample["extra"] = {k: v[i] if i < len(v) else None for k, v in extra.items()}
                f.write(json.dumps(sample, default=str) + "\n")
