"""A start-up check that fails on one host only ends the whole job: two `jaxtune train` processes on CPU (one
device each, --mesh data=2), one of them handed something bad. Both must exit non-zero within a minute, each
printing the failing host's line; nothing waits for a peer that has left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOOD_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(argv_of: list[list[str]], env_of: list[dict[str, str]]) -> list[tuple[int, str, float]]:
    """(exit code, stderr, seconds to exit) of each process of a two-process `jaxtune train` job."""
    port, start = _free_port(), time.perf_counter()
    procs = []
    for i, (argv, extra) in enumerate(zip(argv_of, env_of)):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [extra.pop("PYTHONPATH", ""), ROOT])),
                   JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i), **extra)
        procs.append(subprocess.Popen([sys.executable, "-m", "jaxtune.cli", "train", *argv], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=150)
            results.append((p.returncode, err, time.perf_counter() - start))
    finally:
        for p in procs:
            p.kill()
    return results


def _write_jsonl(path, rows: list[str]) -> str:
    path.write_text("".join(r + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("bad", ["data", "run_dir", "reporter", "yaml"])
def test_a_check_failing_on_one_host_ends_every_process_with_its_line(tmp_path, bad):
    model = tmp_path / "model"  # never loaded: the job must end before any model loads
    model.mkdir()
    good_data = _write_jsonl(tmp_path / "good.jsonl", [json.dumps(GOOD_ROW)] * 40)
    argv = [["--model", str(model), "--data", good_data, "--out", str(tmp_path / f"run{i}"), "--mesh", "data=2",
             "--max-steps", "1"] for i in range(2)]
    env: list[dict[str, str]] = [{}, {}]
    if bad == "data":  # process 1's copy of the dataset has a malformed line 31
        lines = [json.dumps(GOOD_ROW)] * 40
        lines[30] = '{"messages": [{"role": "user", "content": "hi"'
        argv[1][3] = _write_jsonl(tmp_path / "bad.jsonl", lines)
        expected = "bad.jsonl:31: invalid JSON"
    elif bad == "run_dir":  # process 1's --out is a file
        (tmp_path / "run1").write_text("not a directory")
        expected = "run1 is a file"
    elif bad == "reporter":  # wandb cannot be imported on host 1
        shim = tmp_path / "no_wandb"  # as if the package were absent: find_spec answers None
        shim.mkdir()
        (shim / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
        argv = [a + ["--report-to", "wandb"] for a in argv]
        env[1] = {"PYTHONPATH": str(shim), "WANDB_MODE": "disabled"}
        env[0] = {"WANDB_MODE": "disabled"}
        expected = "report_to wandb needs the wandb package"
    else:  # host 1's copy of the YAML has a bad value
        (tmp_path / "good.yaml").write_text("learning_rate: 1e-4\n")
        (tmp_path / "bad.yaml").write_text("learning_rate: -1\n")
        argv[0] += ["--config", str(tmp_path / "good.yaml")]
        argv[1] += ["--config", str(tmp_path / "bad.yaml")]
        expected = "learning_rate"

    (code0, err0, t0), (code1, err1, t1) = _launch(argv, env)
    assert code1 != 0 and f"error in process 1 of 2: " in err1 and expected in err1, err1[-2000:]
    assert code0 != 0, f"process 0 went on after its peer failed a check: {err0[-2000:]}"
    assert "process 1 of 2 refused the run" in err0 and expected in err0, err0[-2000:]
    assert max(t0, t1) < 60, (t0, t1)
    assert "Traceback" not in err0 + err1, (err0 + err1)[-3000:]
