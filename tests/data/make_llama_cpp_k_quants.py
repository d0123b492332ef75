"""Writes tests/data/llama_cpp_k_quants.safetensors: float tensors and the q4_K / q5_K / q6_K bytes that llama.cpp's
own reference quantizers (ggml-quants.c: `quantize_row_q4_K_ref`, `_q5_K_ref`, `_q6_K_ref`, what llama-quantize runs
without an importance matrix) make of them. The suite compares jaxtune's quantizers with these bytes without
building llama.cpp.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    python tests/data/make_llama_cpp_k_quants.py llama_cpp_python-0.3.36/vendor/llama.cpp

It compiles ggml-quants.c alone with the C compiler's defaults (x86-64: no fused multiply-add), the arithmetic of a
portable llama.cpp build, and calls it through ctypes.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

import numpy as np
from safetensors.numpy import save_file

SHIM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) { fprintf(stderr, "%s:%d\n", file, line); abort(); }
size_t ggml_row_size(int type, long ne) { abort(); }
const char *ggml_type_name(int type) { return "?"; }
size_t ggml_type_size(int type) { abort(); }
"""


def inputs() -> dict[str, np.ndarray]:
    """Gaussian weights, heavy tails, per-row scales spanning decades, and edge blocks (zeros, constants, a zero
    sub-block, denormal-small values, a step)."""
    rng = np.random.default_rng(0)
    edges = rng.normal(0, 1, (8, 256)).astype(np.float32)
    edges[0], edges[1], edges[2] = 0.0, 0.5, -0.5
    edges[3, :32] = 0.0
    edges[4] *= 1e-20
    edges[5, 100:] = 3.0
    bf16 = (rng.normal(0, 0.02, (16, 512)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    return {
        "gaussian": rng.normal(0, 0.02, (32, 512)).astype(np.float32),
        "bf16_valued": bf16,  # ties in the rounding
        "heavy_tails": rng.standard_t(3, (16, 768)).astype(np.float32),
        "row_scales": (rng.normal(0, 1, (16, 256)) * np.exp(rng.normal(0, 2, (16, 1)))).astype(np.float32),
        "edges": edges,
    }


def compiled_quants(llama_cpp: str, tmp: str, shim_source: str = SHIM) -> ctypes.CDLL:
    """ggml-quants.c alone, with the C compiler's defaults and a shim for what it calls of the rest of ggml."""
    ggml = os.path.join(llama_cpp, "ggml")
    shim, lib_path = os.path.join(tmp, "shim.c"), os.path.join(tmp, "libquants.so")
    with open(shim, "w") as f:
        f.write(shim_source)
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", os.path.join(ggml, "src", "ggml-quants.c"), shim,
                    f"-I{ggml}/include", f"-I{ggml}/src", "-o", lib_path, "-lm"], check=True)
    return ctypes.CDLL(lib_path)


def main(llama_cpp: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        lib = compiled_quants(llama_cpp, tmp)
        tensors = {}
        for name, x in inputs().items():
            tensors[f"{name}.input"] = x
            for fmt, nbytes in (("q4_K", 144), ("q5_K", 176), ("q6_K", 210)):
                out = np.zeros(x.size // 256 * nbytes, np.uint8)
                getattr(lib, f"quantize_row_{fmt}_ref")(x.ctypes.data_as(ctypes.c_void_p),
                                                        out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
                tensors[f"{name}.{fmt}"] = out.reshape(x.shape[0], -1)
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_k_quants.safetensors")
    save_file(tensors, out_path, metadata={"source": "llama.cpp ggml-quants.c reference quantizers",
                                           "llama_cpp": os.path.basename(os.path.dirname(os.path.abspath(llama_cpp)))})
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(sys.argv[1])
