"""Writes tests/data/llama_cpp_imatrix_quants.safetensors: float tensors, an importance vector per tensor (one weight
per input column, as llama-quantize hands an imatrix entry to the quantizers), and the bytes llama.cpp's own
quantizers make of them with those weights (ggml-quants.c: `quantize_q4_0`, `_q4_1`, `_q5_0`, `_q5_1`, `_q4_K`,
`_q5_K`, `_q6_K` with `quant_weights`, what `llama-quantize --imatrix` runs). The suite compares jaxtune's weighted
quantizers with these bytes without building llama.cpp.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    python tests/data/make_llama_cpp_imatrix_quants.py llama_cpp_python-0.3.36/vendor/llama.cpp

Compiled and called as make_llama_cpp_k_quants.py does (ggml-quants.c alone, the compiler's defaults, ctypes).
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_llama_cpp_k_quants import compiled_quants, inputs  # noqa: E402

# ggml type -> (enum value, weights per block, bytes per block)
FORMATS = {"q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q5_1": (7, 32, 24),
           "q4_K": (12, 256, 144), "q5_K": (13, 256, 176), "q6_K": (14, 256, 210)}

SHIM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) { fprintf(stderr, "%s:%d\n", file, line); abort(); }
size_t ggml_row_size(int type, long ne) {
    switch (type) {
        case 2: return ne / 32 * 18;   case 3: return ne / 32 * 20;   case 6: return ne / 32 * 22;
        case 7: return ne / 32 * 24;   case 12: return ne / 256 * 144; case 13: return ne / 256 * 176;
        case 14: return ne / 256 * 210;
    }
    abort();
}
const char *ggml_type_name(int type) { return "?"; }
size_t ggml_type_size(int type) { abort(); }
"""


def importance(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per-column weights spanning decades (as mean squared activations do), a run of zeros (a column no token
    reached) in some tensors."""
    w = np.exp(rng.normal(0, 1.5, x.shape[1])).astype(np.float32)
    if x.shape[1] >= 512:
        w[32:64] = 0.0
    return w


def main(llama_cpp: str) -> None:
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        lib = compiled_quants(llama_cpp, tmp, SHIM)
        tensors = {}
        for name, x in inputs().items():
            x = np.ascontiguousarray(x[:8])  # 8 rows of each: the blocks' variety, a small file
            w = importance(x, rng)
            tensors[f"{name}.input"], tensors[f"{name}.importance"] = x, w
            for fmt, (_, block, nbytes) in FORMATS.items():
                out = np.zeros(x.size // block * nbytes, np.uint8)
                getattr(lib, f"quantize_{fmt}")(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                                               ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]),
                                               w.ctypes.data_as(ctypes.c_void_p))
                tensors[f"{name}.{fmt}"] = out.reshape(x.shape[0], -1)
    out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_imatrix_quants.safetensors")
    save_file(tensors, out_path, metadata={"source": "llama.cpp ggml-quants.c quantizers with quant_weights",
                                           "llama_cpp": os.path.basename(os.path.dirname(os.path.abspath(llama_cpp)))})
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main(sys.argv[1])
