"""Random preference pairs over the word-level vocabulary of benchmarks/tools/make_bnb4_checkpoint.py ("w0 w1 ..."): one
word is one token, so lengths are exact. The same rows feed jaxtune and Unsloth + TRL (no jax or torch here)."""

from __future__ import annotations

import numpy as np


def random_pairs(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> list[dict[str, str]]:
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(f"w{w}" for w in rng.integers(0, vocab - 3, k))  # noqa: E731
    return [{"prompt": words(prompt_len), "chosen": " " + words(response_len), "rejected": " " + words(response_len)}
            for _ in range(n)]
