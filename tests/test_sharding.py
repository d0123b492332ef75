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

from conftest import FAST_COMPILE
from jaxtune.parallel.sharding import MeshError, array_spec, parse_mesh

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


# the suite's JAX settings the worker processes keep: its compilation cache (a process loads what another compiled:
# the resumed run its first run's step, process 1 what process 0 wrote, the only one that writes) and debug info
KEPT_JAX_SETTINGS = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                     "JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS")


def _env(**extra):
    """The suite's environment with XLA's fast CPU compile flags (conftest's) and the suite's compilation cache, but
    none of its other JAX settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_")) or k in KEPT_JAX_SETTINGS}
    flags = f"{extra.pop('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=flags, **extra)
    return env


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_sharded_step_matches_single_device_on_8_devices():
    proc = subprocess.run([sys.executable, WORKER, "grads"], capture_output=True, text=True, timeout=900,
                          env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = _json_lines(proc.stdout)
    fp8 = [r for r in runs if r.get("compute") == "fp8"]
    moe = [r for r in runs if r.get("model") == "qwen3_moe"]
    runs = [r for r in runs if r.get("compute") != "fp8" and r not in moe]
    assert [r["mesh"] for r in runs] == ["data=8", "data=2,fsdp=4"]
    assert [r["mesh"] for r in moe] == ["data=2,fsdp=2"]
    flash = {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv"}
    for r in moe:  # a mixture of experts: the expert stacks sharded, the attention and NF4 projection kernels (the
        # dense model's) and the experts' dequant and grouped GEMMs per shard (`shard_maps`: the kernels inside a
        # shard_map; the grouped kernel on the global rows ran every device's rows on every device) with no
        # activation moved, the single-device loss and gradients
        assert r["sharded_experts"] and r["moved_activations"] == [], r
        assert set(r["shard_maps"]) >= flash | {"nf4_matmul", "nf4_matmul_dx", "nf4_dequantize", "grouped_matmul"}, r
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["grad_max_abs_diff"] <= 1e-5 * r["grad_scale"] + 1e-7, r
    assert len(fp8) == 1 and set(fp8[0]["shard_maps"]) >= flash | {"fp8_quantize_rows", "fp8_blockscaled_matmul"}, fp8
    r = fp8[0]  # the same e4m3 operands per shard: the loss to float32 rounding, gradients to FP8 rounding flips
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
    assert r["grad_max_abs_diff"] <= 1e-2 * r["grad_scale"], r  # measured 2.8e-3
    assert abs(r["ref_loss"] - r["float32_loss"]) > 1e-5 * abs(r["float32_loss"]), r  # FP8 ran (measured 4.9e-5)
    for r in [*runs, *fp8]:  # FSDP gathers weights; each device keeps its own rows' activations
        assert r["moved_activations"] == [], r
    for r in runs:
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["grad_max_abs_diff"] <= 1e-5 * r["grad_scale"] + 1e-7, r


def test_grpo_samples_and_trains_on_a_mesh_as_on_one_device(tok_dir, tmp_path):
    """GRPO on two devices of one process (FSDP) and on two processes (hosts) of one device each, data-parallel:
    each device samples its share of a rollout (each host scores its share), and the run samples the completions
    and reaches the losses of one device (KL term and the kept sampling log-probabilities included). (Data-parallel
    on two devices of one process is the two hosts' program on one host: the hosts' run covers it.)"""
    def runs(devices: int, meshes: str) -> list[dict]:
        proc = subprocess.run([sys.executable, WORKER, "grpo", str(tok_dir), str(tmp_path / str(devices)), meshes],
                              capture_output=True, text=True, timeout=600,
                              env=_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _json_lines(proc.stdout)

    (want,) = runs(1, "")
    got = runs(2, "fsdp=2")
    assert want["devices"] == 1 and [g["mesh"] for g in got] == ["fsdp=2"] and got[0]["devices"] == 2
    assert len(want["completions"]) == 2 and len(set(map(str, want["completions"][0]))) > 1  # 2 rollouts, varied
    # two processes of one device each (two hosts): each samples and scores its half of every rollout, and both
    # train on the whole
    outs = _two_processes(tok_dir, tmp_path / "hosts", {}, mode="grpo")
    for code, _, err, _ in outs:
        assert code == 0, err[-3000:]
    hosts = [_json_lines(out)[0] for _, out, _, _ in outs]
    assert hosts[0]["devices"] == 2 and (tmp_path / "hosts" / "0" / "completions.jsonl").exists()
    assert all(len(h["completions"][0]) == len(want["completions"][0]) // 2 for h in hosts)  # its own half scored
    got += [{**h, "completions": [a + b for a, b in zip(hosts[0]["completions"], hosts[1]["completions"])]}
            for h in hosts]
    for g in got:
        assert g["completions"] == want["completions"], g["mesh"]
        assert g["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-7), g["mesh"]


def test_data_refused_on_one_host_after_the_join_ends_every_process(tok_dir, tmp_path):
    """Each host tokenizes its own data after the processes join: a refusal there on one host (here its model lacks
    ids its tokenizer makes) ends every process non-zero within a minute, process 0 naming process 1 and its line."""
    outs = _two_processes(tok_dir, tmp_path / "hosts", {"small_vocab_on": 1})
    (code0, _, err0, s0), (code1, _, err1, s1) = outs
    assert code1 != 0 and "the tokenizer belongs to another model" in err1, err1[-2000:]
    assert code0 != 0 and "process 1 of 2 refused its data: the tokenizer made token id" in err0, err0[-2000:]
    assert max(s0, s1) < 60, (s0, s1)
    assert "Traceback" not in err0 + err1, (err0 + err1)[-3000:]


def test_a_reward_function_failing_on_one_host_ends_every_process(tok_dir, tmp_path):
    """Each host scores its own share of a rollout, so a reward function can fail on one host only: every process
    ends non-zero, within a minute, process 0 naming process 1 and its line."""
    outs = _two_processes(tok_dir, tmp_path / "hosts", {}, mode="grpo", REWARD_FAILS_ON_PROCESS="1")
    (code0, _, err0, s0), (code1, _, err1, s1) = outs
    assert code1 != 0 and "reward function length_reward raised ValueError: injected reward failure" in err1
    assert code0 != 0 and ("process 1 of 2 failed scoring its share of the rollout: reward function length_reward "
                           "raised ValueError") in err0, err0[-2000:]
    assert max(s0, s1) < 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _single(tok_dir, out_dir, options: dict) -> dict:
    proc = subprocess.run([sys.executable, WORKER, "train", str(tok_dir), str(out_dir), "", json.dumps(options)],
                          capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _json_lines(proc.stdout)[0]


def _two_processes(tok_dir, out_dir, options: dict, mode: str = "train", **env) -> list[tuple[int, str, str, float]]:
    """(exit code, stdout, stderr, seconds to exit) of each of two processes training with --mesh data=2 (`mode`:
    the worker's "train", or "grpo", which takes no options)."""
    import time

    port, start = _free_port(), time.perf_counter()
    args = [str(tok_dir), str(out_dir), "data=2"] + ([json.dumps(options)] if mode == "train" else [])
    procs = [subprocess.Popen([sys.executable, WORKER, mode, *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
                                       JAX_PROCESS_ID=str(i), **env))
             for i in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            results.append((p.returncode, out, err, time.perf_counter() - start))
    finally:
        for p in procs:
            p.kill()
    return results


@pytest.fixture
def tok_dir(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def test_two_processes_train_a_mixture_of_experts_as_one_and_a_sigterm_to_one_stops_both_then_resume_continues(
        tok_dir, tmp_path):
    """Two processes of one device each (--mesh data=2) train a Qwen3-MoE (8 experts, top 2: routing, grouped
    expert GEMMs and the load-balancing statistics per device) to the losses of one process. A preempted host:
    SIGTERM to process 1 after step 2; both stop after one agreed step, save it once, exit 0; the same command with
    resume reaches the losses of the uninterrupted one-process run."""
    want = _single(tok_dir, tmp_path / "one", {"moe": True, "batch": 8, "steps": 6, "save_steps": 0})
    assert want["devices"] == 1 and len(want["losses"]) == 6 and want["losses"][-1] < want["losses"][0]
    run = tmp_path / "two"
    # "auto": each process reads only its own device's memory (another's is not addressable), and all agree
    options = {"moe": True, "batch": "auto", "steps": 6, "save_steps": 6}
    outs = _two_processes(tok_dir, run, {**options, "sigterm_at": {"process": 1, "step": 2}})
    for code, _, err, _ in outs:
        assert code == 0, err[-3000:]
    got = [_json_lines(out)[0] for _, out, _, _ in outs]
    assert got[1]["process"] == 1 and got[1]["memory_stats"] == {}  # CPU devices keep no statistics
    assert [g["micro_batch_size"] for g in got] == [8, 8]  # CPU default (4 per device), the same on both
    assert sum("micro_batch_size auto" in out for _, out, _, _ in outs) == 1  # printed once
    stopped = {g["steps"] for g in got}
    assert len(stopped) == 1 and 2 <= min(stopped) < 6 and all(g["interrupted"] for g in got)
    stop = stopped.pop()
    for g in got:
        assert g["processes"] == 2 and g["devices"] == 2
        assert g["losses"] == pytest.approx(want["losses"][:stop], rel=1e-5)
    # one checkpoint, written once for both processes
    assert sorted(os.listdir(run / "checkpoints")) == [str(stop)]

    outs = _two_processes(tok_dir, run, {**options, "resume": True})
    for code, _, err, _ in outs:
        assert code == 0, err[-3000:]
    for _, out, _, _ in outs:
        assert _json_lines(out)[0]["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert sorted(os.listdir(run / "checkpoints"), key=int) == [str(stop), "6"]
    with open(run / "metrics.jsonl") as f:  # written by process 0 only, each step once
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 6]


def test_an_error_in_one_process_ends_the_whole_job(tok_dir, tmp_path):
    """Process 1 raises at step 2: it exits non-zero at once with its error; process 0 does not hang."""
    # the two-process step of the SIGTERM test (8 rows of the mixture of experts), which the compilation cache may hold
    outs = _two_processes(tok_dir, tmp_path / "two", {"moe": True, "batch": 8, "steps": 50, "save_steps": 0,
                                                      "raise_at": {"process": 1, "step": 2}},
                          JAXTUNE_HEARTBEAT_TIMEOUT="10")
    (code0, _, err0, _), (code1, _, err1, _) = outs
    assert code1 != 0 and "error in process 1 of 2: injected failure at step 2" in err1
    assert code0 != 0, "process 0 finished a run its peer had failed"
