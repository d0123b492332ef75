"""The longest sequence jaxtune trains at batch 1: one executed step of `jaxtune.train` per length, ascending, on one
loaded model, until a length is refused or fails; optionally with the GPU capped to a card size.

    PYTHONPATH=. python3 benchmarks/ladders/context_ladder.py /tmp/bnb4_70b --seqs 134144 --remat offload
    PYTHONPATH=. python3 benchmarks/ladders/context_ladder.py /tmp/bnb4_70b --cap-gib 48 --seqs 16384,18432,24576
The rows are benchmarks/ladders/learnable_run.py's repeated phrases, each as long as the sequence (a few tokens less), one
per step. Prints one JSON line per length: executed tokens, seconds of `train()` (compiling included), peak GPU
GiB (the process's, so far: the lengths ascend), the least host memory available during the step and XLA's
pinned-pool cap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time


def cap_device_memory(cap_gib: float) -> float:
    """Makes JAX preallocate and use only `cap_gib` of the GPU (a card of that size); returns the fraction."""
    total_mib = float(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, check=True).stdout.split()[0])
    fraction = min(1.0, cap_gib * 1024 / total_mib)
    os.environ["XLA_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    return fraction


class LeastAvailable:
    """Samples MemAvailable while a step runs: the least host memory left (what the step's offload took)."""

    def __init__(self, interval_s: float = 0.5):
        from jaxtune.platform.host_info import meminfo_bytes

        self._read, self._interval, self.least = meminfo_bytes, interval_s, None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.wait(self._interval):
            now = self._read("MemAvailable")
            self.least = now if self.least is None else min(self.least, now)

    def __enter__(self) -> LeastAvailable:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--seqs", required=True, help="comma-separated sequence lengths, tried in ascending order")
    ap.add_argument("--remat", default="offload")
    ap.add_argument("--compute", default="bf16")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--cap-gib", type=float, help="use only this much GPU memory")
    ap.add_argument("--offload-optimizer", action="store_true", help="AdamW's state in host memory between steps")
    ap.add_argument("--offload-embedding", action="store_true",
                    help="the frozen input embedding in host memory during training")
    args = ap.parse_args()
    fraction = cap_device_memory(args.cap_gib) if args.cap_gib else None

    import jax
    from flax import nnx

    import jaxtune
    from benchmarks.ladders.learnable_run import synthetic_rows
    from jaxtune.parallel.distributed import memory_stats, peak_memory_gib
    from jaxtune.platform.host_info import GIB, pinned_cap_bytes
    from jaxtune.training.loop import prepare_data

    t0 = time.perf_counter()
    model, tokenizer = jaxtune.from_pretrained(args.model)
    jax.block_until_ready(nnx.state(model))
    base = {"system": "jaxtune", "model": os.path.basename(args.model.rstrip("/")),
            "device": jax.devices()[0].device_kind, "cap_gib": args.cap_gib, "mem_fraction": fraction,
            "device_limit_gib": round((memory_stats().get("bytes_limit") or 0) / GIB, 2), "batch": 1,
            "lora_r": args.lora_r, "remat": args.remat, "compute": args.compute,
            "offload_optimizer": args.offload_optimizer, "offload_embedding": args.offload_embedding,
            "pinned_cap_gib": round(pinned_cap_bytes() / GIB, 1), "load_s": round(time.perf_counter() - t0, 1)}
    for seq in sorted(int(s) for s in args.seqs.split(",")):
        rows = synthetic_rows(seq, 1, model.config.vocab_size)
        cfg = jaxtune.TrainConfig(format="text", seq_len=seq, micro_batch_size=1, max_steps=1, learning_rate=1e-4,
                                  remat=args.remat, compute=args.compute, packing=False, lora_r=args.lora_r,
                                  lora_alpha=args.lora_r, offload_optimizer=args.offload_optimizer,
                                  offload_embedding=args.offload_embedding)
        tokens = int((prepare_data(rows, tokenizer, cfg)[0].segment_ids > 0).sum())
        record = {**base, "seq": seq, "tokens": tokens}
        t0 = time.perf_counter()
        try:
            with LeastAvailable() as host:
                result = jaxtune.train(model, tokenizer, rows, cfg, progress=False)
            record.update(train_s=round(time.perf_counter() - t0, 1), loss=round(result.losses[-1], 4),
                          tok_s=round(result.tokens_per_second), peak_gib=peak_memory_gib(), remat_used=result.remat,
                          offload_optimizer_used=result.offload_optimizer,
                          offload_embedding_used=result.offload_embedding,
                          least_host_available_gib=None if host.least is None else round(host.least / GIB, 1))
        except Exception as e:  # noqa: BLE001 (the refusal or failure is the result)
            record.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:400]}",
                          after_s=round(time.perf_counter() - t0, 1))
        print(json.dumps(record), flush=True)
        if "error" in record:
            break


if __name__ == "__main__":
    main()
