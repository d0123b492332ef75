"""Group-relative advantages from reward scores, with TRL's GRPOTrainer's arithmetic (float32, NaN-aware)."""

from __future__ import annotations

import numpy as np

EPS = 1e-4  # added to the std before dividing, as TRL does


def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """Sample standard deviation (ddof 1) over the non-NaN values, as TRL's nanstd."""
    count = np.sum(~np.isnan(x), axis=axis)
    mean = np.nanmean(x, axis=axis, keepdims=True)
    var = np.nansum((x - mean) ** 2, axis=axis) / (count - 1)
    return np.sqrt(var).astype(np.float32)


def group_advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int,
                     scale_rewards: str) -> tuple[np.ndarray, dict[str, float]]:
    """(advantage of each completion [N], metrics) for rewards [N, functions] (NaN: a function returned None)
    of N = prompts x num_generations completions, each prompt's group consecutive.

    The weighted sum of a completion's rewards (NaN ones skipped) minus its group's mean, divided by the group's
    (or the batch's) std + 1e-4 unless scale_rewards is "none"; a completion every function skipped is left out
    of the baseline and gets advantage 0.
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        r = rewards_per_func.astype(np.float32)
        unscorable = np.isnan(r).all(axis=1)
        rewards = np.nansum(r * weights.astype(np.float32)[None], axis=1).astype(np.float32)
        rewards[unscorable] = np.nan
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
        metrics = {"reward": float(np.nanmean(rewards)), "reward_std": float(_nanstd(rewards)),
                   "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0)))}
    return advantages, metrics
