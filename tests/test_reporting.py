"""Metrics beyond metrics.jsonl: TensorBoard event files under RUN/tb/ and an offline W&B run, as HF Trainer's
users expect; read back with TensorBoard's own event reader."""

from __future__ import annotations

import json

import pytest

import jaxtune
from jaxtune.errors import JaxtuneError

ROWS = [{"messages": [{"role": "user", "content": f"hello {i}"},
                      {"role": "assistant", "content": f"world {i % 5} fox"}]} for i in range(32)]


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wbc"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wbcache"), "WANDB_DATA_DIR": str(tmp_path / "wbdata")}.items():
        monkeypatch.setenv(var, value)


def test_tensorboard_and_wandb_hold_the_logged_values_at_their_steps(tiny_tokenizer, tiny_qlora_model, tmp_path,
                                                                     offline_wandb):
    run = tmp_path / "run"
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=3, eval_fraction=0.25, eval_steps=2,
                              learning_rate=1e-2, report_to=("tensorboard", "wandb"))
    jaxtune.train(tiny_qlora_model, tiny_tokenizer, ROWS, cfg, out_dir=run, progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tb = _scalars(run / "tb")
    for key, tag in (("loss", "train/loss"), ("lr", "train/learning_rate"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_s", "train/tokens_per_second")):
        assert tb[tag] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], tag
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in evals] == [2, 3]  # every eval_steps, and at the end
    assert tb["eval/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in evals]
    (offline,) = (run / "wandb").glob("offline-run-*")
    run_id = (run / "wandb-run-id").read_text().strip()
    assert (offline / f"run-{run_id}.wandb").stat().st_size > 0


def test_a_resumed_run_continues_the_same_tensorboard_steps(tiny_tokenizer, tiny_qlora_model, tmp_path):
    run = tmp_path / "run"
    cfg = dict(seq_len=64, micro_batch_size=2, learning_rate=1e-2, schedule="constant", report_to="tensorboard")
    jaxtune.train(tiny_qlora_model, tiny_tokenizer, ROWS, jaxtune.TrainConfig(max_steps=2, **cfg), out_dir=run,
                  progress=False)
    jaxtune.train(tiny_qlora_model, tiny_tokenizer, ROWS, jaxtune.TrainConfig(max_steps=4, **cfg), out_dir=run,
                  resume=True, progress=False)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [step for step, _ in _scalars(run / "tb")["train/loss"]] == [r["step"] for r in records] == [1, 2, 3, 4]


def test_a_reporter_without_its_package_is_refused_before_training(tiny_tokenizer, tiny_qlora_model, tmp_path,
                                                                   monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = jaxtune.TrainConfig(seq_len=64, micro_batch_size=2, max_steps=1, report_to=("wandb",))
    with pytest.raises(JaxtuneError, match=r"pip install 'jaxtune\[wandb\]'"):
        jaxtune.train(tiny_qlora_model, tiny_tokenizer, ROWS, cfg, out_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
