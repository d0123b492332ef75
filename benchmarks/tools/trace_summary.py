"""GPU time of a jax.profiler trace (perfetto JSON) grouped by op class; one JSON line, plus the top kernels.

    python3 benchmarks/tools/trace_summary.py /tmp/trace [steps] [top kernels]
Classes come from kernel names (Pallas kernels carry their own names; cuBLAS GEMMs are split by the XLA op
metadata when the trace has it, else reported as one class).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import sys

CLASSES = (
    ("linear attention (gated delta)", r"gated_delta"),
    ("attention", r"flash_attention|fmha|cudnn"),
    ("grouped expert GEMM (MoE)", r"grouped_matmul"),
    ("nf4 dequant (frozen weights)", r"nf4_dequant|nf4_matmul"),
    ("routing (sort, scatter, gather)", r"sort|scatter|gather"),
    ("matmul (cuBLAS)", r"gemm|xmma|cutlass|nvjet|sm90|matmul"),
    ("host transfers", r"HtoD|DtoH|copy_start|copy-start"),
    ("device copies (memcpy)", r"memcpy|Memcpy|DtoD"),
    ("reduce / loss", r"reduce|logsumexp|softmax"),
    ("elementwise / fusion", r"fusion|loop|input_|convert|transpose|copy|dynamic"),
)


def classify(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name):
            return label
    return "other"


def _gpu_events(trace_dir: str):
    """(path, the GPU kernel events) of the newest trace under trace_dir."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)
                  + glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and re.search(r"GPU|gpu|stream", str(e.get("args", {}).get("name", "")))}
    return path, [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]


def kernel_times(trace_dir: str, steps: int = 2) -> collections.Counter:
    """GPU ms per step of each kernel name."""
    times = collections.Counter()
    for e in _gpu_events(trace_dir)[1]:
        times[e.get("name", "")] += float(e.get("dur", 0)) / 1e3 / steps
    return times


def summarize(trace_dir: str, steps: int = 2) -> dict:
    """{"total": GPU ms per step, class: ms per step, ...} of a trace."""
    by_class = collections.Counter()
    for e in _gpu_events(trace_dir)[1]:
        by_class[classify(e.get("name", ""))] += float(e.get("dur", 0)) / 1e3 / steps
    return {"total": round(sum(by_class.values()), 1), **{k: round(v, 1) for k, v in by_class.most_common()}}


def main(trace_dir: str, steps: int = 2, top: int = 45) -> None:
    path, events = _gpu_events(trace_dir)
    by_class, by_kernel = collections.Counter(), collections.Counter()
    for e in events:
        name = e.get("name", "")
        dur = float(e.get("dur", 0)) / 1e3 / steps  # ms per step
        by_class[classify(name)] += dur
        op = str(e.get("args", {}).get("hlo_op", e.get("args", {}).get("long_name", "")))[:80]
        by_kernel[(name[:90], op)] += dur
    total = sum(by_class.values())
    print(json.dumps({"trace": path, "gpu_ms_per_step": round(total, 2),
                      "classes_ms": {k: round(v, 2) for k, v in by_class.most_common()}}))
    for (name, op), ms in by_kernel.most_common(top):
        print(json.dumps({"kernel": name, "op": op, "ms_per_step": round(ms, 3)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2, int(sys.argv[3]) if len(sys.argv) > 3 else 45)
