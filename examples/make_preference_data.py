"""Generates the preference demo dataset: answers in CAPITAL LETTERS are preferred to the same answers in normal case.

A rule SmolLM2-135M-Instruct does not follow out of the box; DPO teaches it from pairs alone (no target text to
imitate beyond the pair). Conversational rows in TRL's preference format. Deterministic:
    python examples/make_preference_data.py   # writes examples/data/caps_train.jsonl and caps_eval.jsonl
caps_eval.jsonl holds questions about countries, numbers and animals never seen in training.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"),
            ("Germany", "Berlin"), ("Peru", "Lima"), ("Egypt", "Cairo"), ("Norway", "Oslo"), ("Spain", "Madrid"),
            ("Italy", "Rome"), ("Ireland", "Dublin"), ("Greece", "Athens"), ("Chile", "Santiago"),
            ("Portugal", "Lisbon"), ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Sweden", "Stockholm"),
            ("Cuba", "Havana"), ("India", "New Delhi"), ("China", "Beijing"), ("Russia", "Moscow"),
            ("Mexico", "Mexico City"), ("Turkey", "Ankara"), ("Finland", "Helsinki")]
ANIMALS = [("dog", "woof"), ("cat", "meow"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"), ("owl", "hoot"),
           ("lion", "roar"), ("horse", "neigh"), ("pig", "oink"), ("frog", "ribbit"), ("goat", "bleat"),
           ("mouse", "squeak")]


def qa(rng: random.Random, capitals, animals, numbers) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        country, capital = rng.choice(capitals)
        return f"What is the capital of {country}?", f"The capital of {country} is {capital}."
    if kind == 1:
        a, b = rng.choice(numbers), rng.choice(numbers)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    animal, sound = rng.choice(animals)
    return f"What sound does a {animal} make?", f"A {animal} says {sound}."


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).resolve().parent / "data"
    out.mkdir(exist_ok=True)
    train_split = (CAPITALS[:18], ANIMALS[:9], list(range(2, 30)))
    held_out = (CAPITALS[18:], ANIMALS[9:], list(range(30, 60)))
    with open(out / "caps_train.jsonl", "w") as f:
        for _ in range(256):
            question, answer = qa(rng, *train_split)
            f.write(json.dumps({"prompt": [{"role": "user", "content": question}],
                                "chosen": [{"role": "assistant", "content": answer.upper()}],
                                "rejected": [{"role": "assistant", "content": answer}]}) + "\n")
    with open(out / "caps_eval.jsonl", "w") as f:
        for _ in range(24):
            question, answer = qa(rng, *held_out)
            f.write(json.dumps({"prompt": question, "answer": answer}) + "\n")


if __name__ == "__main__":
    main()
