"""The HLO of kernels a trace names: each fusion's call (shapes, the JAX source op in its metadata) and its fused
computation, read from an XLA dump (`XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`).

    python3 benchmarks/tools/hlo_fusions.py DIR input_multiply_reduce_fusion_1 loop_add_fusion_2 [--module jit_step]
A trace's kernel `name_N` is the instruction `name.N` of the module after optimizations.
"""

from __future__ import annotations

import argparse
import glob
import os
import re


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dump")
    ap.add_argument("kernels", nargs="+")
    ap.add_argument("--module", default="jit_step", help="the jitted function's name in the dump's file names")
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.dump, f"*{args.module}*after_optimizations.txt")), key=os.path.getsize)
    if not files:
        raise SystemExit(f"no '*{args.module}*after_optimizations.txt' in {args.dump}")
    text = open(files[-1]).read()
    computations = {m.group(1): m.group(0) for m in re.finditer(r"^%?([\w.\-]+) [^\n]*\{\n(?:.*\n)*?\}", text, re.M)}
    for kernel in args.kernels:
        name = re.sub(r"_(\d+)$", r".\1", kernel)
        calls = [line.strip() for line in text.splitlines() if re.search(rf"%{re.escape(name)} = ", line)]
        print(f"=== {kernel} ({os.path.basename(files[-1])})")
        for call in calls[:2]:
            print(call[:1500])
            fused = re.search(r"calls=%?([\w.\-]+)", call)
            if fused and fused.group(1) in computations:
                print(computations[fused.group(1)][:4000])


if __name__ == "__main__":
    main()
