"""Generates the demo dataset: extract a person's details from a sentence as JSON in a fixed schema.

A skill SmolLM2-135M-Instruct lacks out of the box (it answers in prose or with other keys). Deterministic:
    python examples/make_demo_data.py   # writes examples/data/people_train.jsonl and people_eval.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Maria", "John", "Aiko", "Liam", "Fatima", "Carlos", "Elena", "Noah", "Priya", "Omar", "Sofia", "Lucas",
         "Hana", "Mateo", "Zara", "Ivan", "Chloe", "Ravi", "Nina", "Felix", "Amara", "Jonas", "Leila", "Tomas",
         "Yuki", "Diego", "Ines", "Kofi", "Marta", "Arjun"]
JOBS = ["nurse", "teacher", "engineer", "baker", "pilot", "lawyer", "chef", "farmer", "painter", "doctor",
        "architect", "librarian", "plumber", "dentist", "journalist"]
CITIES = ["Lisbon", "Tokyo", "Nairobi", "Toronto", "Berlin", "Lima", "Cairo", "Oslo", "Madrid", "Seoul",
          "Dublin", "Austin", "Prague", "Manila", "Quito"]
TEMPLATES = [
    "{name} is a {age}-year-old {job} who lives in {city}.",
    "Meet {name}, {age}, {a_job} based in {city}.",
    "{name} works as {a_job} in {city} and is {age} years old.",
    "At {age}, {name} is {a_job} living in {city}.",
    "From {city}, {name} ({age}) works as {a_job}.",
]
INSTRUCTION = "Extract the person as JSON with keys name, age, job, city."
TRAIN_NAMES, EVAL_NAMES = NAMES[:24], NAMES[24:]  # held-out prompts use names never seen in training


def example(rng: random.Random, names: list[str]) -> tuple[str, str]:
    person = {"name": rng.choice(names), "age": rng.randint(19, 79), "job": rng.choice(JOBS), "city": rng.choice(CITIES)}
    article = "an" if person["job"][0] in "aeiou" else "a"
    sentence = rng.choice(TEMPLATES).format(**person, a_job=f"{article} {person['job']}")
    return f"{INSTRUCTION}\n{sentence}", json.dumps(person)


def more_heldout(n: int, seed: int = 1) -> list[dict]:
    """n further held-out prompts like people_eval.jsonl's (for comparisons finer than its 24 allow)."""
    rng = random.Random(seed)
    return [{"prompt": prompt, "answer": answer} for prompt, answer in (example(rng, EVAL_NAMES) for _ in range(n))]


def main() -> None:
    rng = random.Random(0)
    out = Path(__file__).resolve().parent / "data"
    out.mkdir(exist_ok=True)
    with open(out / "people_train.jsonl", "w") as f:
        for _ in range(400):
            prompt, answer = example(rng, TRAIN_NAMES)
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    with open(out / "people_eval.jsonl", "w") as f:
        for _ in range(24):
            prompt, answer = example(rng, EVAL_NAMES)
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")


if __name__ == "__main__":
    main()
