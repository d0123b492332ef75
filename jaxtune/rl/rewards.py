"""Reward functions with TRL's signature: f(prompts, completions, completion_ids=..., **columns) -> scores.

A function gets one list entry per completion (each prompt repeated for its group), the dataset's other columns
as keyword lists, and returns one float (or None: "does not apply") per completion. Given as callables, as
"FILE.py:FUNC", or by a built-in name: "last_number" (1.0 when the completion's last number equals the row's
`answer` column) or "regex:PATTERN" (1.0 when the completion matches PATTERN from its start).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxtune.errors import ConfigError, JaxtuneError


class RewardError(JaxtuneError, RuntimeError):
    """A reward function raised, or returned the wrong number of scores or something other than numbers."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    name: str
    fn: Callable[..., Sequence[float | None]]


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


def score(funcs: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list], where: Sequence[str]) -> np.ndarray:
    """Rewards [completions, functions], NaN where a function returned None; `where` names each completion's
    dataset row for the errors."""
    out = np.zeros((len(completions), len(funcs)), np.float32)
    for j, f in enumerate(funcs):
        try:
            values = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # noqa: BLE001 (the user's function: its error, in one line)
            raise RewardError(f"reward function {f.name} raised {type(e).__name__}: {e} (batch starting at "
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
