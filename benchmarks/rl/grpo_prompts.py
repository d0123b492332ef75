"""GRPO benchmark prompts over the word-level vocabulary of benchmarks/tools/make_bnb4_checkpoint.py ("w0 w1 ...": one
word is one token, so lengths are exact) and a reward of random scores; the same for jaxtune and Unsloth + TRL
(no jax or torch here)."""

from __future__ import annotations

import zlib

import numpy as np


def random_prompts(n: int, prompt_len: int, vocab: int, seed: int = 0) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    return [{"prompt": " ".join(f"w{w}" for w in rng.integers(0, vocab - 3, prompt_len))} for _ in range(n)]


def random_reward(prompts, completions, **_) -> list[float]:
    """A score per completion from its text's hash: groups get different rewards, so every advantage counts."""
    return [zlib.crc32(str(c).encode()) / 2**32 for c in completions]
