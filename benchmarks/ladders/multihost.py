"""Multi-process training on one host, one process per GPU, exactly as README's multi-host launch lines run it.

    PYTHONPATH=. python3 benchmarks/ladders/multihost.py [--work /tmp/multihost] [--cases a,b,c,d]

Builds a tiny random Llama (float32) and a text dataset, then runs `jaxtune train` (the CLI) as N processes
(N = the GPUs visible, at least 2), each with CUDA_VISIBLE_DEVICES=i and JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID, and checks:
  a. 8 steps with a checkpoint at 4 and a resume equal one process driving all GPUs (--mesh data=N), 1e-3 rel
  b. --batch-size auto: every process trains the same micro-batch, printed once
  c. SIGTERM to one process: all stop after the same step, save it, exit 0; --resume reaches (a)'s losses
  d. SIGKILL of one process: the others end within 2 minutes, non-zero, saying a peer failed
  e. a malformed dataset on one process only: every process ends within a minute, non-zero, with its line
  f. GRPO (--objective grpo, a reward function from a file): 3 steps as N processes equal one process driving all
     GPUs (losses and rewards, 1e-3 rel): each process samples and scores its share of the rollout
  g. GRPO with the reward function raising on one process only: every process ends within a minute, non-zero,
     naming the function
Prints one JSON line per case and exits non-zero if any check fails. The 8B throughput of N processes vs one
process is `scale_qlora.py` (it reads the same environment variables).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_STEPS = 40  # constant learning rate: the losses of step i do not depend on --max-steps
TRAIN = ["--format", "text", "--seq-len", "128", "--batch-size", "8", "--dtype", "float32", "--schedule", "constant",
         "--lr", "1e-3", "--lora-r", "8"]


def make_model_and_data(work: str) -> tuple[str, str]:
    """A 2-layer random Llama as a jaxtune NF4 checkpoint (with a byte-level BPE tokenizer), and 400 text rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from convert.jaxtune_format import write_checkpoint
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers

    rows = [{"text": f"row {i}: " + " ".join(["the quick brown fox jumps over the lazy dog"] * (1 + i % 7))}
            for i in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([r["text"] for r in rows[:50]], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    cfg = ModelConfig(model_type="llama", vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, eos_token_id=tokenizer.eos_token_id)
    model_dir, data = os.path.join(work, "model"), os.path.join(work, "data.jsonl")
    shutil.rmtree(model_dir, ignore_errors=True)
    write_checkpoint(quantize_layers(init_model(cfg, dtype="float32", seed=0)), tokenizer, model_dir, quantization="nf4")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return model_dir, data


REWARDS = '''import os


def length_reward(prompts, completions, **columns):
    if os.environ.get("JAX_PROCESS_ID") == os.environ.get("REWARD_FAILS_ON_PROCESS", "none"):
        raise ValueError("no reward on this host")
    return [len(c) / 100.0 for c in completions]
'''


def make_grpo_data(work: str) -> tuple[str, str]:
    """48 prompts and a reward function file (completions' length) for the GRPO cases."""
    prompts, rewards = os.path.join(work, "prompts.jsonl"), os.path.join(work, "rewards.py")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": f"row {i}: the quick brown fox"}) + "\n" for i in range(48))
    with open(rewards, "w") as f:
        f.write(REWARDS)
    return prompts, rewards


def rewards_logged(run: str) -> list[float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line)["reward"] for line in f if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(process: int | None, n: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(NCCL_NVLS_ENABLE="0", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    if process is not None:
        env.update(CUDA_VISIBLE_DEVICES=str(process), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(process))
    return env


def launch(n: int, args: list[str], logs: str, last: list[str] | None = None) -> list[subprocess.Popen]:
    """N processes of `jaxtune train ARGS` (the last one `last`, where given), one per GPU; output to
    logs/p<i>.log."""
    os.makedirs(logs, exist_ok=True)
    port = free_port()
    procs = []
    for i in range(n):
        with open(os.path.join(logs, f"p{i}.log"), "w") as log:  # the child keeps its own copy of the handle
            argv = last if last is not None and i == n - 1 else args
            procs.append(subprocess.Popen([sys.executable, "-m", "jaxtune.cli", "train", *argv], stdout=log,
                                          stderr=subprocess.STDOUT, env=env_for(i, n, port), cwd=ROOT))
    return procs


def wait(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int | None], list[float]]:
    """Exit codes (None: still running at the timeout, then killed) and seconds each took."""
    start, codes, times = time.perf_counter(), [None] * len(procs), [0.0] * len(procs)
    while time.perf_counter() - start < timeout and any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None and p.poll() is not None:
                codes[i], times[i] = p.returncode, time.perf_counter() - start
        time.sleep(0.2)
    for i, p in enumerate(procs):
        if codes[i] is None:
            p.kill()
            times[i] = time.perf_counter() - start
    return codes, times


def losses(run: str) -> list[float]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def close(a: list[float], b: list[float], rel: float = 1e-3) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


def log_text(logs: str, i: int) -> str:
    with open(os.path.join(logs, f"p{i}.log")) as f:
        return f.read()


def log_tail(logs: str, i: int, lines: int = 3) -> list[str]:
    return [line.rstrip() for line in log_text(logs, i).splitlines()[-lines:]]


def signal_masks(pid: int) -> dict:
    """Whether SIGTERM is caught by the process, and how many of its threads block it (from /proc)."""
    bit = 1 << (signal.SIGTERM - 1)

    def mask(path: str, key: str) -> int:
        with open(path) as f:
            return int(next(line for line in f if line.startswith(key)).split()[1], 16)

    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return {"caught": bool(mask(f"/proc/{pid}/status", "SigCgt") & bit),
                "ignored": bool(mask(f"/proc/{pid}/status", "SigIgn") & bit), "threads": len(tasks),
                "threads_blocking": sum(bool(mask(f"/proc/{pid}/task/{t}/status", "SigBlk") & bit) for t in tasks)}
    except (OSError, StopIteration) as e:
        return {"error": str(e)}


def wait_for_step(run: str, step: int, timeout: float = 300) -> None:
    path, start = os.path.join(run, "metrics.jsonl"), time.perf_counter()
    while time.perf_counter() - start < timeout:
        if os.path.exists(path) and len(losses(run)) >= step:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{run} did not reach step {step}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/multihost")
    ap.add_argument("--cases", default="a,b,c,d,e,f,g")
    args = ap.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"  # this driver builds the tiny model on the CPU; the GPUs are the workers'
    gpus = shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.count("GPU ")
    n = max(2, gpus or 0)  # no GPU: two CPU processes (a dry run of the same checks)
    os.makedirs(args.work, exist_ok=True)
    model, data = make_model_and_data(args.work)
    base = ["--model", model, "--data", data, *TRAIN]
    ok = True

    def report(case: str, passed: bool, **fields) -> None:
        nonlocal ok
        ok &= passed
        print(json.dumps({"case": case, "processes": n, "passed": passed, **fields}), flush=True)

    def run_dir(name: str) -> str:
        path = os.path.join(args.work, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    # reference: one process driving every GPU
    ref = run_dir("ref")
    t0 = time.perf_counter()
    env = env_for(None, n, 0)
    if not gpus:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
    proc = subprocess.run([sys.executable, "-m", "jaxtune.cli", "train", *base, "--out", ref, "--mesh", f"data={n}",
                           "--max-steps", str(REFERENCE_STEPS)], env=env, cwd=ROOT, capture_output=True, text=True)
    want = losses(ref) if proc.returncode == 0 else []
    report("reference", proc.returncode == 0, seconds=round(time.perf_counter() - t0, 1), losses=want,
           tail=proc.stderr.splitlines()[-3:])

    cases = set(args.cases.split(","))
    if "a" in cases:
        run, logs = run_dir("a"), os.path.join(args.work, "logs-a")
        t0 = time.perf_counter()
        codes1, _ = wait(launch(n, [*base, "--out", run, "--mesh", f"data={n}", "--max-steps", "4", "--save-steps", "4"], logs), 600)
        codes2, _ = wait(launch(n, [*base, "--out", run, "--mesh", f"data={n}", "--max-steps", "8", "--resume"], logs), 600)
        got = losses(run) if os.path.exists(os.path.join(run, "metrics.jsonl")) else []
        report("a: checkpoint at 4, resume to 8", codes1 == [0] * n and codes2 == [0] * n and close(got, want[:8]),
               exit_codes=[codes1, codes2], losses=got, checkpoints=sorted(os.listdir(os.path.join(run, "checkpoints"))),
               seconds=round(time.perf_counter() - t0, 1))
    if "b" in cases:
        run, logs = run_dir("b"), os.path.join(args.work, "logs-b")
        codes, _ = wait(launch(n, [*base, "--out", run, "--max-steps", "3", "--batch-size", "auto"], logs), 600)
        printed = [log_text(logs, i).count("micro_batch_size auto") for i in range(n)]
        with open(os.path.join(run, "config.json")) as f:
            micro = json.load(f)["micro_batch_size"]
        report("b: --batch-size auto", codes == [0] * n and sum(printed) == 1, exit_codes=codes, micro_batch_size=micro,
               printed_by_process=printed, tail=log_tail(logs, 0, 2))
    if "c" in cases:
        run, logs = run_dir("c"), os.path.join(args.work, "logs-c")
        procs = launch(n, [*base, "--out", run, "--max-steps", "100000"], logs)
        wait_for_step(run, 2)
        masks = signal_masks(procs[n - 1].pid)
        procs[n - 1].send_signal(signal.SIGTERM)
        codes, times = wait(procs, 300)
        stopped = [s for s in os.listdir(os.path.join(run, "checkpoints")) if s.isdigit()]
        stop_tail = log_tail(logs, n - 1, 6)
        until = min(int(stopped[0]) + 3, REFERENCE_STEPS) if len(stopped) == 1 else REFERENCE_STEPS
        codes2, _ = wait(launch(n, [*base, "--out", run, "--max-steps", str(until), "--resume"], logs + "-resume"), 600)
        got = losses(run)
        report("c: SIGTERM to one process", codes == [0] * n and len(stopped) == 1 and int(stopped[0]) + 3 <= until
               and codes2 == [0] * n and close(got, want[:until]), exit_codes=[codes, codes2], stopped_at=stopped, seconds_to_stop=[round(t, 1) for t in times],
               losses=got, signal_masks=masks, tail=stop_tail)
    if "d" in cases:
        run, logs = run_dir("d"), os.path.join(args.work, "logs-d")
        procs = launch(n, [*base, "--out", run, "--max-steps", "100000"], logs)
        wait_for_step(run, 3)
        killed_at = time.perf_counter()
        procs[n - 1].kill()
        codes, _ = wait(procs[:-1], 180)
        seconds = round(time.perf_counter() - killed_at, 1)
        report("d: SIGKILL of one process", all(c not in (None, 0) for c in codes) and seconds <= 120,
               exit_codes=codes, seconds_until_all_ended=seconds, tail=log_tail(logs, 0, 2))
    if "e" in cases:
        run, logs = run_dir("e"), os.path.join(args.work, "logs-e")
        bad = os.path.join(args.work, "bad.jsonl")
        with open(data) as f, open(bad, "w") as out:
            lines = f.readlines()
            lines[30] = lines[30][: len(lines[30]) // 2] + "\n"  # line 31 cut in half
            out.writelines(lines)
        argv = [*base, "--out", run, "--max-steps", "3"]
        codes, times = wait(launch(n, argv, logs, last=[*argv[:3], bad, *argv[4:]]), 180)
        line = "bad.jsonl:31: invalid JSON"
        report("e: a bad dataset on one process", all(c not in (None, 0) for c in codes) and max(times) <= 60
               and all(line in log_text(logs, i) for i in range(n)), exit_codes=codes,
               seconds=[round(t, 1) for t in times], tail=log_tail(logs, 0, 1) + log_tail(logs, n - 1, 1))
    if cases & {"f", "g"}:
        prompts, rewards = make_grpo_data(args.work)
        grpo = ["--model", model, "--data", prompts, "--objective", "grpo", "--reward", f"{rewards}:length_reward",
                "--num-generations", "4", "--max-completion-length", "24", "--batch-size", "8", "--dtype", "float32",
                "--schedule", "constant", "--lr", "1e-3", "--lora-r", "8", "--seed", "3", "--mesh", f"data={n}"]
    if "f" in cases:
        one, run, logs = run_dir("f-one"), run_dir("f"), os.path.join(args.work, "logs-f")
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "jaxtune.cli", "train", *grpo, "--out", one, "--max-steps", "3"],
                              env=env, cwd=ROOT, capture_output=True, text=True)
        codes, _ = wait(launch(n, [*grpo, "--out", run, "--max-steps", "3"], logs), 600)
        ok_runs = proc.returncode == 0 and codes == [0] * n
        want_f, got_f = (losses(one), losses(run)) if ok_runs else ([], [])
        want_r, got_r = (rewards_logged(one), rewards_logged(run)) if ok_runs else ([], [])
        report("f: GRPO as N processes", ok_runs and len(got_f) == 3 and close(got_f, want_f) and close(got_r, want_r),
               exit_codes=[proc.returncode, codes], losses=got_f, one_process_losses=want_f, rewards=got_r,
               one_process_rewards=want_r, seconds=round(time.perf_counter() - t0, 1),
               tail=proc.stderr.splitlines()[-2:] + log_tail(logs, 0, 2))
    if "g" in cases:
        run, logs = run_dir("g"), os.path.join(args.work, "logs-g")
        os.environ["REWARD_FAILS_ON_PROCESS"] = str(n - 1)  # the workers' environment (env_for) inherits it
        try:
            codes, times = wait(launch(n, [*grpo, "--out", run, "--max-steps", "3"], logs), 300)
        finally:
            del os.environ["REWARD_FAILS_ON_PROCESS"]
        report("g: GRPO, a reward failing on one process", all(c not in (None, 0) for c in codes)
               and max(times) <= 60 + min(times) and all("length_reward" in log_text(logs, i) for i in range(n)),
               exit_codes=codes, seconds=[round(t, 1) for t in times],
               tail=log_tail(logs, 0, 1) + log_tail(logs, n - 1, 1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
