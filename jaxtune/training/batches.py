"""Where a run's batches come from, the one thing objectives do differently in the loop: packed dataset rows
(SFT, DPO, ORPO) or completions sampled from the policy and scored by reward functions (GRPO).

A source has `batch_extra` (arrays a batch holds besides the token ones, to plan the step before data flows),
`single_sequence_rows`, `len()` (rows one pass makes, for auto batch), `start(micro_batch, accum)`,
`next(lora, frozen, step)` -> host arrays [rows, ...], `state()` / `restore()` for checkpoints, `metrics` (the last
batch's, for the step's record) and `efficiency` (the share of row slots holding tokens).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxtune.data import BatchStream, PackedRows, encode_rows, pack_examples, read_rows
from jaxtune.data.preference import encode_pairs, pack_pairs
from jaxtune.data.sources import DataError, Row
from jaxtune.parallel.distributed import agree_on_checks
from jaxtune.errors import JaxtuneError
from jaxtune.training.config import TrainConfig


def rows_from(data: str | os.PathLike | Sequence[dict[str, Any] | Row]) -> list[Row]:
    if isinstance(data, (str, os.PathLike)):
        return read_rows(data)
    rows = [r if isinstance(r, Row) else Row(r, f"data[{i}]") for i, r in enumerate(data)]
    if not rows:
        raise DataError("the dataset is empty; it needs at least one row")
    return rows


def prepare_data(data, tokenizer, cfg: TrainConfig, progress: bool = True) -> tuple[PackedRows, PackedRows | None]:
    """(train rows, held-out rows or None), packed (SFT examples, or preference pairs for DPO/ORPO); the held-out
    split is drawn from cfg.seed."""
    rows = rows_from(data)
    eval_rows: list[Row] = []
    if cfg.eval_fraction > 0:
        order = np.random.default_rng(cfg.seed).permutation(len(rows))
        n_eval = max(1, int(len(rows) * cfg.eval_fraction))
        eval_rows = [rows[i] for i in sorted(order[:n_eval])]
        rows = [rows[i] for i in sorted(order[n_eval:])]

    def pack(rows: list[Row]) -> PackedRows:
        if cfg.objective != "sft":  # preference pairs: prompt / chosen / rejected
            pairs = encode_pairs(rows, tokenizer, cfg.objective, progress=progress)
            return pack_pairs(pairs, cfg.seq_len, packing=cfg.packing, drop_long_prompts=cfg.drop_long_prompts,
                              share_prompt=cfg.share_prompt)
        examples = encode_rows(rows, cfg.format, tokenizer, train_on_all=cfg.train_on_all, progress=progress)
        return pack_examples(examples, cfg.seq_len, packing=cfg.packing)

    return pack(rows), pack(eval_rows) if eval_rows else None


class PackedBatches:
    """SFT / DPO / ORPO: the dataset's packed rows in seeded epochs (data.BatchStream), a held-out split beside."""

    def __init__(self, train_rows: PackedRows, eval_rows: PackedRows | None, seed: int):
        self.train_rows, self.eval_rows, self.seed = train_rows, eval_rows, seed
        self.batch_extra = {k: (v.shape[1:], v.dtype) for k, v in train_rows.extra.items()}
        # rows of one sequence each (no packing happened): plain causal attention, which cuDNN serves
        self.single_sequence_rows = all(int(r.segment_ids.max(initial=0)) <= 1 for r in (train_rows, eval_rows)
                                        if r is not None)
        self.metrics: dict[str, float] = {}
        self.stream: BatchStream | None = None

    def __len__(self) -> int:
        return len(self.train_rows)

    @property
    def efficiency(self) -> float:
        return self.train_rows.efficiency

    def start(self, micro_batch: int, accum: int) -> None:
        self.stream = BatchStream(self.train_rows, micro_batch=micro_batch, accum=accum, seed=self.seed)

    @property
    def micro_batch(self) -> int:
        return self.stream.micro_batch

    @micro_batch.setter
    def micro_batch(self, value: int) -> None:
        self.stream.micro_batch = value

    @property
    def accum(self) -> int:
        return self.stream.accum

    @accum.setter
    def accum(self, value: int) -> None:
        self.stream.accum = value

    def next(self, lora, frozen, step: int) -> dict[str, np.ndarray]:
        return self.stream.next()

    def state(self) -> dict[str, Any]:
        return self.stream.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.stream.restore(state)


def check_token_ids(ids: Sequence[np.ndarray], tokenizer, vocab_size: int) -> None:
    """A DataError when the tokenizer made an id the model has no embedding for (a tokenizer from another model:
    left alone, the lookup reads past the table and the loss turns NaN)."""
    top = max((int(a.max(initial=0)) for a in ids if a.size), default=0)
    if top >= vocab_size:
        token = tokenizer.convert_ids_to_tokens(top) if hasattr(tokenizer, "convert_ids_to_tokens") else top
        raise DataError(f"the tokenizer made token id {top} ({token!r}) but the model's vocabulary has {vocab_size} "
                        f"ids: the tokenizer belongs to another model; load the model and its tokenizer from the "
                        f"same checkpoint")


_runs = itertools.count()  # this process's runs: each run's agreement on its data has a name of its own


def make_batches(data, tokenizer, cfg: TrainConfig, model, *, progress: bool = True,
                 reward_funcs: Sequence[str | Callable] | None = None, reward_weights: Sequence[float] | None = None,
                 run_dir: str | None = None, lead: bool = True):
    """The run's batch source for cfg.objective. Each host reads and tokenizes its own data, so a refusal on one host
    (a row its tokenizer makes ids the model lacks, a prompt too long) ends every host, each with that line."""
    try:
        source, failure = _batch_source(data, tokenizer, cfg, model, progress, reward_funcs, reward_weights, run_dir,
                                        lead), None
    except JaxtuneError as e:
        source, failure = None, e
    agree_on_checks(failure, stage=f"data/{next(_runs)}", failed="refused its data")
    return source


def _batch_source(data, tokenizer, cfg: TrainConfig, model, progress, reward_funcs, reward_weights, run_dir, lead):
    if cfg.objective != "grpo":
        if reward_funcs:
            raise DataError(f"reward functions apply to objective 'grpo' only; objective is {cfg.objective!r}")
        train_rows, eval_rows = prepare_data(data, tokenizer, cfg, progress)
        check_token_ids([r.input_ids for r in (train_rows, eval_rows) if r is not None], tokenizer,
                        model.config.vocab_size)
        return PackedBatches(train_rows, eval_rows, seed=cfg.seed)
    from jaxtune.rl.rewards import check_weights, resolve_rewards
    from jaxtune.rl.rollout import check_prompt_rows, encode_prompts
    from jaxtune.rl.source import Rollouts

    funcs = resolve_rewards(reward_funcs or [])
    weights = check_weights(reward_weights, funcs)
    rows = rows_from(data)
    check_prompt_rows(rows)
    prompt_ids = encode_prompts(rows, tokenizer, cfg.seq_len - cfg.max_completion_length)
    check_token_ids([np.asarray(p) for p in prompt_ids], tokenizer, model.config.vocab_size)
    return Rollouts(rows, prompt_ids, tokenizer, model, cfg, funcs, weights, run_dir, lead)
