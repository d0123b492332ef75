"""The quickstart notebook and the example scripts run as shipped (CPU), on SmolLM2 cut to 2 layers (the
`short_smollm2` fixture): every call the user makes runs; what the fine-tune learns is what CI's `make demo` checks
on the full model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import example_env

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes(short_smollm2):
    """Every cell runs, with 2 training steps on 2 held-out prompts instead of 50 on 4, answers of 16 tokens instead of
    48 and one preference pair a step instead of 2 (that the fine-tune learns is what CI's full `make demo` checks:
    0% -> 88%); the reloaded adapter answers as the trained model."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    shortened = {"max_steps=50": "max_steps=2", "[:4]": "[:2]", "max_steps=3": "max_steps=1",
                 "max_new_tokens=48": "max_new_tokens=16",
                 "seq_len=256, micro_batch_size=2": "seq_len=256, micro_batch_size=1"}
    for cell in nb.cells:
        for old, new in shortened.items():
            cell.source = cell.source.replace(old, new)
    assert {new for cell in nb.cells for new in shortened.values() if new in cell.source} == set(shortened.values())
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "examples")}}).execute(env=example_env())
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "the reloaded adapter reproduces the fine-tuned answers" in text
    assert "exact match after fine-tuning: " in text and "/2" in text.split("exact match after fine-tuning: ")[1]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the loss plot is inline
    assert not [o for o in outputs if o.get("output_type") == "error"]


def test_readme_shell_block_runs_on_the_cli(short_smollm2, tmp_path):
    """The README's shell walkthrough (convert -> train -> export PEFT + GGUF -> generate with the adapter) runs as
    written, in a scratch directory, with 1 training step of 2 rows instead of 12 of 4 and an answer of 16 tokens
    instead of 48."""
    import re

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    script = blocks[1]
    assert script.startswith("source .venv/bin/activate\n") and "--max-steps 12" in script
    assert "--batch-size 4" in script and "--max-new-tokens 48" in script
    script = (script.replace("source .venv/bin/activate\n", "").replace("--max-steps 12", "--max-steps 1")
              .replace("--batch-size 4", "--batch-size 2").replace("--max-new-tokens 48", "--max-new-tokens 16"))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = example_env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists() and (tmp_path / "tuned.gguf").exists()
    assert "onto" in proc.stdout and proc.stdout.strip().splitlines()[-1]  # the generation printed something


EXAMPLE_SCRIPTS = ["train_own_chat.py", "export_and_run_merged.py", "demo.py", "dpo_demo.py", "grpo_demo.py"]


def test_example_scripts_have_help():
    """Each script's --help prints its usage and exits 0 (run as `__main__` in one process: one import of jax)."""
    run = ("import runpy, sys\n"
           "sys.path.insert(0, 'examples')\n"
           "for script in sys.argv[1:]:\n"
           "    print(f'== {script}', flush=True)\n"
           "    sys.argv = [script, '--help']\n"
           "    try:\n"
           "        runpy.run_path(f'examples/{script}', run_name='__main__')\n"
           "    except SystemExit as e:\n"
           "        print(f'exit {e.code}', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", run, *EXAMPLE_SCRIPTS], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    sections = proc.stdout.split("== ")[1:]
    assert [section.split("\n")[0] for section in sections] == EXAMPLE_SCRIPTS, proc.stdout[-2000:]
    for section in sections:
        assert "usage" in section and section.rstrip().endswith("exit 0"), section


def test_shipped_demo_data_is_what_the_generator_writes(tmp_path):
    import shutil

    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    for script in ("make_demo_data.py", "make_preference_data.py"):
        subprocess.run([sys.executable, str(tmp_path / "examples" / script)], check=True, timeout=120)
    for name in ("people_train.jsonl", "people_eval.jsonl", "caps_train.jsonl", "caps_eval.jsonl"):
        assert (tmp_path / "examples" / "data" / name).read_text() == (ROOT / "examples" / "data" / name).read_text()


def test_demo_runs_end_to_end(short_smollm2, tmp_path, request):
    """`make demo` runs examples/demo.py. CI runs it in full just before the suite and names its output directory
    in JAXTUNE_TEST_DEMO_RUN: then this checks that run's outputs instead of running it a second time; otherwise
    it runs here with 2 steps scored on 2 prompts (the README's numbers come from the full 16 steps, 24 prompts)."""
    import json

    done = os.environ.get("JAXTUNE_TEST_DEMO_RUN")
    if done:
        out, steps = Path(done), 16
    else:
        out, steps = tmp_path / "demo", 2
        out.mkdir()
        (out / "smollm2-nf4").symlink_to(request.getfixturevalue("smollm2_nf4"))  # converted once per worker
        proc = subprocess.run([sys.executable, "examples/demo.py", "--steps", "2", "--eval-limit", "2", "--out",
                               str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env=example_env())
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "exact match on held-out prompts" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == steps and 0.0 <= results["exact_match_after"] <= 1.0
    assert (out / "run" / "loss.png").exists() and (out / "smollm2-nf4" / "jaxtune.json").exists()
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == steps and all(np.isfinite(r["loss"]) for r in records)


def test_dpo_demo_runs_end_to_end(short_smollm2, smollm2_nf4, tmp_path):
    """examples/dpo_demo.py with one step (docs/training.md's numbers come from the full 40)."""
    (tmp_path / "dpo").mkdir()
    (tmp_path / "dpo" / "smollm2-nf4").symlink_to(smollm2_nf4)  # converted once per worker
    proc = subprocess.run([sys.executable, "examples/dpo_demo.py", "--steps", "1", "--eval-limit", "2", "--out",
                           str(tmp_path / "dpo")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=example_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    results = json.loads((tmp_path / "dpo" / "results.json").read_text())
    assert results["steps"] == 1 and 0.0 <= results["capitals_after"] <= 1.0
    assert 0.0 <= results["eval_reward_accuracy_after"] <= 1.0
    records = [json.loads(line) for line in (tmp_path / "dpo" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/margins" in records[-1] and "eval_rewards/accuracies" in records[-1]


def test_grpo_demo_runs_end_to_end(short_smollm2, smollm2_nf4, tmp_path):
    """examples/grpo_demo.py with one step of one question's 8 answers, scored on 2 held-out questions
    (docs/training.md's numbers come from the full 20 steps of 4 questions, 32 held-out)."""
    import json

    (tmp_path / "grpo").mkdir()
    (tmp_path / "grpo" / "smollm2-nf4").symlink_to(smollm2_nf4)  # converted once per worker
    proc = subprocess.run([sys.executable, "examples/grpo_demo.py", "--steps", "1", "--eval-limit", "2",
                           "--prompts-per-step", "1", "--out", str(tmp_path / "grpo")], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env=example_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads((tmp_path / "grpo" / "results.json").read_text())
    assert results["steps"] == 1 and 0.0 <= results["right_after"] <= 1.0
    records = [json.loads(line) for line in (tmp_path / "grpo" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["reward"] <= 1.0 and "rewards/last_number/mean" in r for r in records)
    samples = (tmp_path / "grpo" / "run" / "completions.jsonl").read_text().splitlines()
    assert len(samples) == 1 * 8 and "held-out sums right" in proc.stdout
