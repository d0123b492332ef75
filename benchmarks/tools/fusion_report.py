"""What the largest non-GEMM kernels of a profiled step compute: each kernel's GPU time beside its fusion in the
optimized HLO (output shape, the ops it fuses), one JSON line per kernel.

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*step.*" \
        python3 benchmarks/steps/train_qlora.py CKPT --profile /tmp/trace ...
    python3 benchmarks/tools/fusion_report.py /tmp/trace /tmp/dump [steps] [top]
Kernel names are the fusions' instruction names with '.' written '_', so a trace names its HLO by itself.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import sys

from benchmarks.tools.trace_summary import classify, kernel_times

INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\([^=]*?\)|\S+) (\w[\w\-]*)\((.*)$")


def fusions(hlo_text: str) -> tuple[dict[str, tuple[str, str]], dict[str, list[tuple[str, str]]]]:
    """({kernel name: (output shape, called computation)}, {computation: [(opcode, shape)]}) of an HLO module."""
    calls, bodies, current = {}, collections.defaultdict(list), None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$", line)
        if head:
            current = head[1]
            continue
        m = INSTRUCTION.match(line)
        if not m or current is None:
            continue
        name, shape, opcode, rest = m.groups()
        bodies[current].append((opcode, shape))
        if opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            calls[name.replace(".", "_")] = (shape, called[1] if called else "")
    return calls, bodies


def main(trace_dir: str, dump_dir: str, steps: int = 2, top: int = 30) -> None:
    texts = sorted(glob.glob(f"{dump_dir}/*after_optimizations.txt"), key=os.path.getsize, reverse=True)
    calls, bodies = fusions(open(texts[0]).read()) if texts else ({}, {})
    times = kernel_times(trace_dir, steps)
    shown = 0
    for name, ms in times.most_common():
        if classify(name) in ("matmul (cuBLAS)", "attention"):
            continue
        shape, called = calls.get(name, ("?", ""))
        ops = collections.Counter(op for op, _ in bodies.get(called, []) if op not in ("parameter", "constant"))
        params = [s for op, s in bodies.get(called, []) if op == "parameter"]
        print(json.dumps({"kernel": name, "ms_per_step": round(ms, 3), "class": classify(name), "shape": shape,
                          "params": params[:8], "ops": dict(ops.most_common(12))}))
        shown += 1
        if shown == top:
            break


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:5]))
