"""Data parallel + FSDP: mesh parsing, sharded steps equal to the single-device step (8 forced CPU devices),
and a 2-process jax.distributed run on localhost training to the same losses as one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from jaxtune.sharding import MeshError, array_spec, parse_mesh

WORKER = os.path.join(os.path.dirname(__file__), "sharded_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_mesh_fills_and_checks_axes():
    assert parse_mesh(None, 8) == {"data": 8, "fsdp": 1}
    assert parse_mesh("data=2,fsdp=4", 8) == {"data": 2, "fsdp": 4}
    assert parse_mesh("fsdp=4", 8) == {"data": 2, "fsdp": 4}
    assert parse_mesh({"data": -1, "fsdp": 2}, 8) == {"data": 4, "fsdp": 2}
    for bad, words in [("data=3,fsdp=2", "needs 6 devices"), ("fsdp=3", "does not divide"), ("tp=2", "unknown axis"),
                       ("data:2", "not axis=size"), ("data=0", "positive")]:
        with pytest.raises(MeshError, match=words):
            parse_mesh(bad, 8)


def test_fsdp_rule_picks_the_largest_divisible_dim_and_never_the_layer_axis():
    assert array_spec((32, 4096, 2048), 4, stacked=True) == P(None, "fsdp")
    assert array_spec((32, 1024, 14336), 8, stacked=True) == P(None, None, "fsdp")
    assert array_spec((128256, 4096), 8, stacked=False) == P("fsdp")
    assert array_spec((32, 3, 5001), 4, stacked=True) == P()  # nothing divides: replicated
    assert array_spec((32, 4096), 1, stacked=True) == P()


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)
    return env


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_sharded_step_matches_single_device_on_8_devices():
    proc = subprocess.run([sys.executable, WORKER, "grads"], capture_output=True, text=True, timeout=900,
                          env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = _json_lines(proc.stdout)
    assert {r["mesh"] for r in runs} == {"data=8", "fsdp=8", "data=2,fsdp=4", "data=4,fsdp=2", "data=2,fsdp=2"}
    for r in runs:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["grad_max_abs_diff"] <= 1e-5 * r["grad_scale"] + 1e-7, r
        if r["kernels"] == "pallas-interpret":  # the Pallas kernels ran per shard
            assert r["shard_maps"] >= 2, r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_train_to_the_same_losses_as_one(tiny_tokenizer, tmp_path):
    tok_dir = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(tok_dir)
    single = subprocess.run([sys.executable, WORKER, "train", str(tok_dir), str(tmp_path / "one")],
                            capture_output=True, text=True, timeout=600, env=_env())
    assert single.returncode == 0, single.stderr[-3000:]
    want = _json_lines(single.stdout)[0]
    assert want["devices"] == 1 and len(want["losses"]) == 5

    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "train", str(tok_dir), str(tmp_path / "two"), "data=2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i)))
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = [_json_lines(out)[0] for out, _ in outs]
    for g in got:
        assert g["processes"] == 2 and g["devices"] == 2
        assert g["losses"] == pytest.approx(want["losses"], rel=1e-5)
    # one checkpoint, written once for both processes; metrics written by process 0 only
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["5"]
    with open(tmp_path / "two" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5]
