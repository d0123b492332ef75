"""The variable-length workload of the end-to-end benchmark, shared by jaxtune's and the baselines' runners.

Instruction-tuning-like lengths: log-normal with median 250 tokens, clipped to 20..1500, random token ids.
"""

from __future__ import annotations

import numpy as np

MEDIAN, SIGMA, LOW, HIGH = 250, 0.8, 20, 1500


def sample_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(MEDIAN), SIGMA, n)), LOW, HIGH).astype(np.int64)


def sample_sequences(n: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(0, vocab, int(k)).astype(np.int32) for k in sample_lengths(n, seed)]
