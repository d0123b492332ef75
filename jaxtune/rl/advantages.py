"""Group-relative advantages from reward scores, with TRL's GRPOTrainer's arithmetic (float32, NaN-aware)."""

from __future__ import annotations

import warnings

import numpy as np

EPS = 1e-4  # added to the std before dividing, as TRL does


def _nanstd(x: np.ndarray, axis=None, keepdims: bool = False) -> np.ndarray:
    """Sample standard deviation (ddof 1) over the non-NaN values, as TRL's nanstd: NaN where fewer than two
    values are there (a group nothing scored has no spread, not a zero one)."""
    count = np.sum(~np.isnan(x), axis=axis, keepdims=keepdims)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an empty slice's mean is NaN, as meant
        mean = np.nanmean(x, axis=axis, keepdims=True)
    total = np.nansum((x - mean) ** 2, axis=axis, keepdims=keepdims)
    var = np.where(count > 1, total / np.maximum(count - 1, 1), np.nan)
    return np.sqrt(var).astype(np.float32)


def group_advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int,
                     scale_rewards: str, aggregation: str = "sum_then_normalize",
                     ) -> tuple[np.ndarray, dict[str, float]]:
    """(advantage of each completion [N], metrics) for rewards [N, functions] (NaN: a function returned None)
    of N = prompts x num_generations completions, each prompt's group consecutive.

    "sum_then_normalize": the weighted sum of a completion's rewards (NaN ones skipped) minus its group's mean,
    divided by the group's (or the batch's) std + 1e-4 unless scale_rewards is "none". "normalize_then_sum"
    (GDPO): each function's rewards normalized within the group first, their weighted sum then normalized over
    the batch. A completion every function skipped is left out of the baselines and gets advantage 0.
    """
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mean of a group nothing scored is NaN, as meant
        r = rewards_per_func.astype(np.float32)
        w = weights.astype(np.float32)[None]
        unscorable = np.isnan(r).all(axis=1)
        weighted = np.nansum(r * w, axis=1).astype(np.float32)  # what is logged, whatever the aggregation
        weighted[unscorable] = np.nan
        if aggregation == "normalize_then_sum":
            grouped = r.reshape(-1, num_generations, r.shape[1])
            per_func = (grouped - np.nanmean(grouped, axis=1, keepdims=True)) / (
                _nanstd(grouped, axis=1, keepdims=True) + np.float32(EPS))
            rewards = np.nansum(per_func.reshape(r.shape) * w, axis=1).astype(np.float32)
            rewards[unscorable] = np.nan
            std = np.full_like(rewards, _nanstd(rewards))
            advantages = (rewards - np.nanmean(rewards)) / (std + np.float32(EPS))
        else:
            rewards = weighted
            grouped = rewards.reshape(-1, num_generations)
            mean = np.repeat(np.nanmean(grouped, axis=1), num_generations)
            if scale_rewards == "batch":
                std = np.full_like(rewards, _nanstd(rewards))
            else:  # "group", and "none" (where it is only logged)
                std = np.repeat(_nanstd(grouped, axis=1), num_generations)
            advantages = rewards - mean
            if scale_rewards != "none":
                advantages = advantages / (std + np.float32(EPS))
        advantages = np.nan_to_num(advantages, nan=0.0).astype(np.float32)
        metrics = {"reward": float(np.nanmean(weighted)), "reward_std": float(_nanstd(weighted)),
                   "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0)))}
    return advantages, metrics
