"""Reinforcement learning with verifiable rewards: GRPO (and Dr. GRPO, DAPO, BNPO, GSPO) as TRL defines it.

rewards.py calls the reward functions, advantages.py normalizes their scores within each prompt's group,
rollout.py samples completions from the policy being trained, source.py turns them into the step's batches,
loss.py is the clipped surrogate objective the step minimizes.
"""

from jaxtune.rl.rewards import RewardFunction, resolve_rewards

__all__ = ["RewardFunction", "resolve_rewards"]
