"""GRPO learns as fast as TRL's GRPOTrainer on a learnable task (tests/grpo_learning.py): over several seeds, the
reward jaxtune reaches equals TRL's within the seeds' spread, from the same start."""

from __future__ import annotations

import numpy as np
import pytest

from grpo_learning import make_task, run_jaxtune, run_trl

pytest.importorskip("trl")

SEEDS, STEPS = range(6), 60


@pytest.mark.slow
def test_grpo_reaches_trls_reward_on_a_learnable_task(tmp_path):
    rows = make_task(str(tmp_path))

    def curve(log):
        rewards = np.array([r["reward"] for r in log])
        return rewards[:10].mean(), rewards[-10:].mean()

    trl = np.array([curve(run_trl(str(tmp_path), rows, seed, STEPS)) for seed in SEEDS])
    ours = np.array([curve(run_jaxtune(str(tmp_path), rows, seed, STEPS)) for seed in SEEDS])
    assert len(trl) == len(ours) == len(SEEDS)
    # both start where the random policy is and both learn (the task can tell a trainer that does not)
    assert abs(trl[:, 0].mean() - ours[:, 0].mean()) < 0.1
    assert trl[:, 1].mean() > trl[:, 0].mean() + 0.3 and ours[:, 1].mean() > ours[:, 0].mean() + 0.3
    spread = max(trl[:, 1].std(), ours[:, 1].std())
    assert abs(ours[:, 1].mean() - trl[:, 1].mean()) <= spread, (trl[:, 1], ours[:, 1])
