"""Reward functions with TRL's signature: f(prompts, completions, completion_ids=..., **columns) -> scores.

A function gets one list entry per completion (each prompt repeated for its group), the dataset's other columns
as keyword lists, and returns one float (or None: "does not apply") per completion. Given as callables, as
"FILE.py:FUNC", or by a built-in name: "last_number" (1.0 when the completion's last number equals the row's
`answer` column) or "regex:PATTERN" (1.0 when the completion matches PATTERN from its start).

A function that takes them (by name, or through **kwargs) also gets what TRL's GRPOTrainer passes: `trainer_state`
(the step, max_steps, epoch, tokens seen), `log_extra(column, values)` (a column beside each completion in
completions.jsonl) and `log_metric(name, value)` (a scalar in metrics.jsonl, averaged over the rollout's calls).
`async def` functions run concurrently with each other, on their own event loop (so also from a notebook).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import inspect
import math
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxtune.errors import ConfigError, JaxtuneError


class RewardError(JaxtuneError, RuntimeError):
    """A reward function raised, or returned the wrong number of scores or something other than numbers."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    name: str
    fn: Callable[..., Sequence[float | None]]


@dataclasses.dataclass
class TrainerState:
    """The fields of transformers' TrainerState that TRL hands reward functions as `trainer_state` (for shaping a
    reward by training progress): optimizer steps taken before this rollout, the run's length, epochs of the
    prompts done, and prompt + completion tokens sampled so far."""

    global_step: int
    max_steps: int
    epoch: float
    num_input_tokens_seen: int
    logging_steps: int = 1
    save_steps: int = 0
    is_world_process_zero: bool = True


class RewardLogs:
    """What reward functions logged through `log_extra` and `log_metric` during one rollout's scoring."""

    def __init__(self):
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def metric_means(self) -> dict[str, float]:
        return {name: sum(v) / len(v) for name, v in self.metrics.items() if v}


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _text(completion: Any) -> str:
    """A completion's text: the string, or the content of its (assistant) messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def last_number(prompts, completions, answer=None, **_) -> list[float | None]:
    """1.0 when the last number in the completion equals the row's `answer` (numbers compared as floats), else
    0.0; None for rows without an answer."""
    if answer is None:
        raise ValueError("the built-in reward last_number needs an 'answer' column in the data")
    scores: list[float | None] = []
    for completion, want in zip(completions, answer):
        if want is None:
            scores.append(None)
            continue
        found = _NUMBER.findall(_text(completion))
        got, expected = (_as_number(found[-1]) if found else None), _as_number(str(want))
        scores.append(float(got is not None and expected is not None and math.isclose(got, expected)))
    return scores


def regex_reward(pattern: str) -> Callable[..., list[float]]:
    """1.0 for completions that `pattern` matches from their start (re.match, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)

    def matches(prompts, completions, **_) -> list[float]:
        return [float(compiled.match(_text(c)) is not None) for c in completions]

    return matches


def _from_file(spec: str) -> RewardFunction:
    path, _, func = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"reward {spec!r}: no file {path}; give FILE.py:FUNCTION with an existing file")
    module_name = f"jaxtune_reward_{abs(hash(os.path.abspath(path)))}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 (the user's file: its own error, in one line)
        raise ConfigError(f"reward {spec!r}: importing {path} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, func, None)
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {path} has no function {func!r}")
    return RewardFunction(func, fn)


def resolve_rewards(specs: Sequence[str | Callable | RewardFunction]) -> list[RewardFunction]:
    """Reward functions from callables, "FILE.py:FUNC" strings and built-in names, each named as TRL names it
    (the function's __name__) for the metrics; refuses a missing file or function before any model loads."""
    if not specs:
        raise ConfigError("objective 'grpo' needs at least one reward function: pass reward_funcs=[...] "
                          "(CLI: --reward FILE.py:FUNC, last_number or regex:PATTERN)")
    funcs = []
    for spec in specs:
        if isinstance(spec, RewardFunction):
            funcs.append(spec)
        elif callable(spec):
            funcs.append(RewardFunction(getattr(spec, "__name__", type(spec).__name__), spec))
        elif spec == "last_number":
            funcs.append(RewardFunction("last_number", last_number))
        elif isinstance(spec, str) and spec.startswith("regex:"):
            try:
                funcs.append(RewardFunction("regex", regex_reward(spec[len("regex:"):])))
            except re.error as e:
                raise ConfigError(f"reward {spec!r}: not a regular expression ({e})") from None
        elif isinstance(spec, str) and ":" in spec and spec.rpartition(":")[0].endswith(".py"):
            funcs.append(_from_file(spec))
        else:
            raise ConfigError(f"unknown reward {spec!r}; give a callable, FILE.py:FUNCTION, last_number or "
                              "regex:PATTERN")
    return funcs


def check_weights(weights: Sequence[float] | None, funcs: Sequence[RewardFunction]) -> np.ndarray:
    if weights is None:
        return np.ones(len(funcs), np.float32)
    weights = [float(w) for w in weights]
    if len(weights) != len(funcs) or not all(math.isfinite(w) for w in weights):
        raise ConfigError(f"reward_weights has {len(weights)} finite values for {len(funcs)} reward functions; "
                          "give one weight per function")
    return np.asarray(weights, np.float32)


def _accepted(fn: Callable, extras: dict[str, Any]) -> dict[str, Any]:
    """The TRL extras `fn` can take: all of them through **kwargs, else those its signature names (a function
    written for jaxtune's plain signature keeps working)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return extras
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return extras
    names = {p.name for p in params}
    return {k: v for k, v in extras.items() if k in names}


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _run_concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    """The async reward calls gathered on one fresh event loop in a worker thread (a notebook's loop may be
    running in this one); each result, or the exception it raised."""
    async def one(call):
        return await call()

    async def gather():
        return await asyncio.gather(*(one(call) for call in calls), return_exceptions=True)

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, gather()).result()


def score(funcs: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], where: Sequence[str], extras: dict[str, Any] | None = None) -> np.ndarray:
    """Rewards [completions, functions], NaN where a function returned None; `where` names each completion's
    dataset row for the errors, `extras` the TRL keyword arguments (trainer_state, log_extra, log_metric)."""
    out = np.zeros((len(completions), len(funcs)), np.float32)
    extras = extras or {}

    def call(f: RewardFunction):
        return f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                    **_accepted(f.fn, extras))

    results: dict[int, Any] = {}
    waiting = [j for j, f in enumerate(funcs) if _is_async(f.fn)]
    for j, f in enumerate(funcs):
        if j not in waiting:
            try:
                results[j] = call(f)
            except Exception as e:  # noqa: BLE001 (the user's function: its error, in one line)
                results[j] = e
    if waiting:
        results.update(zip(waiting, _run_concurrently([lambda f=funcs[j]: call(f) for j in waiting])))
    for j, f in enumerate(funcs):
        values = results[j]
        if isinstance(values, Exception):
            raise RewardError(f"reward function {f.name} raised {type(values).__name__}: {values} (batch starting at "
                              f"{where[0]})") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(f"reward function {f.name} returned {type(values).__name__}, not a list of floats "
                              f"(batch starting at {where[0]})") from None
        if len(values) != len(completions):
            raise RewardError(f"reward function {f.name} returned {len(values)} rewards for {len(completions)} "
                              f"completions (batch starting at {where[0]}); return one per completion")
        for i, v in enumerate(values):
            if v is None:
                out[i, j] = np.nan
            elif isinstance(v, (bool, int, float, np.number, np.bool_)) and math.isfinite(float(v)):
                out[i, j] = float(v)
            else:
                raise RewardError(f"reward function {f.name} returned {v!r} for completion {i} ({where[i]}); "
                                  "rewards must be finite numbers or None")
    return out
