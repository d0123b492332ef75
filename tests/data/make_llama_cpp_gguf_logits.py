"""Writes tests/data/llama_cpp_gguf_logits.json: llama.cpp's own logits of jaxtune's GGUF of seeded random gpt-oss
fine-tunes (tests/gguf_families.py), every position of a fixed row longer than the sliding window, with the file's
sha256 (the suite checks that it writes the same file, then compares these logits with transformers'); and each
tensor's type and sha256 in what llama.cpp's quantizer writes from that f32 file as q8_0, f16 and bf16 (the suite
checks jaxtune's own files of those types against them).

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF" python3.12 -m venv V && V/bin/pip install numpy \\
        llama_cpp_python-0.3.36.tar.gz
    PYTHONPATH=tests .venv/bin/python tests/data/make_llama_cpp_gguf_logits.py V/bin/python
The GGUFs are written with the project's environment; the logits are read by V's llama-cpp-python in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gguf_families import CASES, IDS, family_gguf  # noqa: E402
from make_llama_quantize_mixes import _tensors as tensors  # noqa: E402  (each tensor's type and sha256)
from tiny_tokenizer import save_tiny_tokenizer  # noqa: E402

READ = """
import json, sys
import numpy as np
from llama_cpp import Llama, __version__
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, logits_all=True, verbose=False, n_threads=2)
ids = json.loads(sys.argv[2])
llm.eval(ids)
print(json.dumps({"version": __version__, "logits": np.asarray(llm.scores[:len(ids)], np.float64).tolist()}))
"""
QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3].upper())
assert llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) == 0
"""
QUANTIZED = ("q8_0", "f16", "bf16")


def main(llama_python: str) -> None:
    from transformers import AutoTokenizer

    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_tokenizer(os.path.join(tmp, "tok"))
        tok = AutoTokenizer.from_pretrained(os.path.join(tmp, "tok"))
        for case in CASES:
            path, _ = family_gguf(case, tok, tmp)
            digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
            run = subprocess.run([llama_python, "-c", READ, path, json.dumps(IDS)], check=True, capture_output=True,
                                 text=True)
            read = json.loads(run.stdout.strip().splitlines()[-1])
            out[case] = {"sha256": digest, "logits": [[round(v, 6) for v in row] for row in read["logits"]],
                         "quantized": {}}
            for ftype in QUANTIZED:
                target = os.path.join(tmp, f"{case}-{ftype}.gguf")
                subprocess.run([llama_python, "-c", QUANTIZE, path, target, ftype], check=True, capture_output=True)
                out[case]["quantized"][ftype] = tensors(target)
            out["_source"] = {"llama_cpp_python": read["version"]}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_gguf_logits.json")
    with open(path, "w") as f:
        json.dump(out, f, sort_keys=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
