"""What a user meets beyond the happy path: resuming with other settings, outputs that cannot be written, a run
exported from another directory, the bundled model's original weights, files that others must read, spreadsheet
CSVs, and a quiet, one-line command line."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from transformers import LlamaConfig

import jaxtune
from conftest import CHAT, build_hf_model
from jaxtune.cli import main
from jaxtune.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("jaxtune: error: "), lines
    return lines[0]


def _trained_run(run: Path, **settings) -> None:
    """A run directory as `jaxtune train` leaves it: config.json with the settings, a checkpoint."""
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"train": TrainConfig(**settings).to_dict(), "base_model": "smollm2"}))


@pytest.mark.parametrize("flags, message", [
    (["--lora-r", "8"], "was trained with lora_r=16, not 8"),
    (["--lora-alpha", "64"], "was trained with lora_alpha=16.0, not 64.0"),
    (["--seq-len", "512"], "was trained with seq_len=1024, not 512"),
])
def test_resume_with_a_setting_the_checkpoints_depend_on_is_refused_before_loading(tmp_path, chat_data, capsys,
                                                                                 no_model_load, flags, message):
    _trained_run(tmp_path / "run", lora_r=16, lora_alpha=16)
    before = (tmp_path / "run" / "config.json").read_text()
    code = main(["train", "--model", "smollm2", "--data", str(chat_data), "--out", str(tmp_path / "run"), "--resume",
                 *flags])
    line = _one_error_line(capsys)
    assert code == 1 and message in line and "train into a new output directory" in line, line
    assert (tmp_path / "run" / "config.json").read_text() == before


def test_resume_may_change_what_the_checkpoints_do_not_depend_on(tmp_path):
    from jaxtune.training.checkpoint import check_run_dir

    _trained_run(tmp_path / "run", lora_r=16, max_steps=10)
    check_run_dir(tmp_path / "run", True, TrainConfig(lora_r=16, max_steps=500, save_steps=5, logging_steps=2))
    with pytest.raises(jaxtune.JaxtuneError, match="was trained with learning_rate=0.0002, not 0.001"):
        check_run_dir(tmp_path / "run", True, TrainConfig(lora_r=16, learning_rate=1e-3))


def _read_only_dir() -> str:
    """A directory nothing may create files in, root included (sysfs is mounted read-only / refuses new files)."""
    try:
        fd, probe = tempfile.mkstemp(dir="/sys")
    except OSError:
        return "/sys"
    os.close(fd)
    os.remove(probe)
    pytest.skip("/sys accepts new files on this machine")


@pytest.mark.parametrize("argv", [
    ["export", "RUN", "--peft", "RO/adapter"],
    ["export", "RUN", "--merged", "RO/merged"],
    ["export", "RUN", "--gguf", "RO/tuned.gguf"],
    ["convert", "smollm2", "RO/nf4"],
])
def test_an_output_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, capsys, no_model_load, argv):
    ro = _read_only_dir()
    argv = [a.replace("RO", ro).replace("RUN", str(tmp_path / "run")) for a in argv]
    assert main(argv) == 1
    line = _one_error_line(capsys)
    assert f"{ro} is not writable" in line and "choose another output path" in line, line


def test_a_run_records_its_model_so_it_exports_from_any_directory(tmp_path, tiny_tokenizer, monkeypatch):
    model_dir = tmp_path / "work" / "tiny"
    build_hf_model(LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2), model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    (tmp_path / "work" / "d.jsonl").write_text((json.dumps(CHAT) + "\n") * 8)
    monkeypatch.chdir(tmp_path / "work")
    assert main(["train", "--model", "tiny", "--data", "d.jsonl", "--out", "run", "--max-steps", "1", "--seq-len", "32",
                 "--batch-size", "2", "--dtype", "float32"]) == 0
    recorded = json.loads((tmp_path / "work" / "run" / "config.json").read_text())["base_model"]
    assert recorded == str(model_dir)
    monkeypatch.chdir(tmp_path)  # elsewhere
    assert main(["export", "work/run", "--peft", "adapter"]) == 0
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)


def test_a_run_on_the_bundled_name_merges_onto_the_bundled_original(smollm2_path):
    from convert.export import original_weights

    assert original_weights("smollm2") == smollm2_path  # the GGUF itself, not dequantized NF4


def test_outputs_get_the_permissions_a_plain_open_gives(tmp_path, tiny_qlora_model, tiny_tokenizer):
    old = os.umask(0o022)
    try:
        jaxtune.get_peft_model(tiny_qlora_model, r=4)
        jaxtune.save_peft(tiny_qlora_model, tmp_path / "adapter")
        from convert.jaxtune_format import write_checkpoint

        write_checkpoint(tiny_qlora_model, tiny_tokenizer, tmp_path / "ckpt", quantization="nf4")
    finally:
        os.umask(old)
    for out in (tmp_path / "adapter", tmp_path / "ckpt"):
        assert stat.S_IMODE(out.stat().st_mode) == 0o755, out
        for f in out.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_a_gguf_gets_the_permissions_a_plain_open_gives(tmp_path, tiny_tokenizer):
    from test_gguf_export import SMALL, _trained_like

    model, tok = _trained_like(tmp_path, LlamaConfig(vocab_size=len(tiny_tokenizer), **SMALL), tiny_tokenizer)
    old = os.umask(0o027)
    try:
        jaxtune.save_gguf(model, tmp_path / "model.gguf", tokenizer=tok, base=tmp_path / "base", gguf_type="f16")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.gguf").stat().st_mode) == 0o640


@pytest.mark.parametrize("name, text", [
    ("bom.csv", "prompt,response\nhi,hello\nhey,there\n"),
    ("bom.jsonl", '{"prompt": "hi", "response": "hello"}\n{"prompt": "hey", "response": "there"}\n'),
])
def test_a_utf8_bom_is_read(tmp_path, name, text):
    """What spreadsheet tools write as "CSV UTF-8" starts with a byte-order mark."""
    from jaxtune.data import read_rows

    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    rows = read_rows(path)
    assert [r.data["prompt"] for r in rows] == ["hi", "hey"]


def test_train_with_progress_off_prints_no_bars(tiny_tokenizer, tiny_qlora_model, capsys):
    cfg = TrainConfig(format="chat", seq_len=32, micro_batch_size=2, max_steps=1)
    jaxtune.train(tiny_qlora_model, tiny_tokenizer, [CHAT] * 4, cfg, progress=False)
    err = capsys.readouterr().err
    assert "tokenizing" not in err and "training" not in err, err


def test_version_and_a_misspelled_yaml_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == "jaxtune 0.1.0"
    with pytest.raises(jaxtune.ConfigError, match=r"unknown option\(s\) learing_rate \(did you mean learning_rate\?\)"):
        TrainConfig.from_dict({"learing_rate": 1e-4})


def _python(code: str, env_extra: dict[str, str] | None = None, hide_torch: bool = False, tmp=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
    if hide_torch:  # as on the base install: find_spec("torch") answers None
        (tmp / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
        env["PYTHONPATH"] = f"{tmp}{os.pathsep}{ROOT}"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_no_pytorch_note_on_the_base_install(tmp_path):
    plain = _python("import transformers", hide_torch=True, tmp=tmp_path)
    assert "PyTorch was not found" in plain.stderr  # what transformers prints without torch
    ours = _python("import jaxtune, transformers", hide_torch=True, tmp=tmp_path)
    assert ours.returncode == 0 and "PyTorch was not found" not in ours.stderr, ours.stderr


def test_cli_warnings_are_one_line_without_a_source_line(tmp_path, chat_data):
    (tmp_path / "a-file").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "jaxtune.cli", "train", "--model", "smollm2", "--data", str(chat_data),
                           "--out", str(tmp_path / "a-file"), "--max-steps", "2", "--warmup-steps", "2"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and lines[0].startswith("jaxtune: warning: ") and "warmup" in lines[0], lines
    assert lines[1].startswith("jaxtune: error: ") and len(lines) == 2, lines
