"""Writes tests/data/llama_quantize_mixes.json: the tensor types (and, for the small models, each tensor's bytes as
a sha256) that llama.cpp's own `llama-quantize` writes from jaxtune's f32 GGUF of seeded random models, for every
GGUF type jaxtune exports. The suite checks jaxtune's own mix against these without building llama.cpp.

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF && \\
        cmake --build build --target llama-quantize -j
    python tests/data/make_llama_quantize_mixes.py llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize

The models are `mix_model(case)` of tests/gguf_mixes.py (also what the suite builds); the tokenizer is the suite's
tiny one (tests/tiny_tokenizer.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gguf_mixes import BYTES_CASES, CASES, FTYPES, mix_model  # noqa: E402
from tiny_tokenizer import save_tiny_tokenizer  # noqa: E402


def _tensors(path: str) -> dict[str, tuple[str, str]]:
    import gguf

    return {t.name: (t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest())
            for t in gguf.GGUFReader(path).tensors}


def main(quantize: str) -> None:
    import jaxtune
    from transformers import AutoTokenizer

    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_tokenizer(os.path.join(tmp, "tok"))
        tok = AutoTokenizer.from_pretrained(os.path.join(tmp, "tok"))
        for case in CASES:
            model = mix_model(case, len(tok))
            f32 = os.path.join(tmp, f"{case}-f32.gguf")
            jaxtune.save_gguf(model, f32, tokenizer=tok, gguf_type="f32")
            out[case] = {"types": {}, "sha256": {}}
            for ftype in FTYPES:
                path = os.path.join(tmp, f"{case}-{ftype}.gguf")
                subprocess.run([quantize, f32, path, ftype.upper()], check=True, capture_output=True)
                tensors = _tensors(path)
                out[case]["types"][ftype] = {name: ty for name, (ty, _) in tensors.items()}
                if case in BYTES_CASES:
                    out[case]["sha256"][ftype] = {name: digest for name, (_, digest) in tensors.items()}
                os.remove(path)
            os.remove(f32)
    release = [part for part in os.path.abspath(quantize).split(os.sep) if part.startswith("llama_cpp_python-")]
    out["_source"] = {"llama_quantize": f"llama.cpp vendored in {release[0] if release else 'an unknown release'}"}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_quantize_mixes.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
