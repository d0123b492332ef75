"""Writes tests/data/llama_quantize_imatrix.json: the tensor types and each tensor's bytes (sha256) that llama.cpp's
own `llama-quantize --imatrix` writes from jaxtune's f32 GGUF of seeded random dense models, with an importance
matrix jaxtune wrote in llama.cpp's imatrix GGUF layout, for every type an importance matrix changes. The suite
checks `save_gguf(..., imatrix=...)` against these without building llama.cpp.

Build llama-quantize as tests/data/make_llama_quantize_mixes.py says, then:

    python tests/data/make_llama_quantize_imatrix.py llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize

The models are `imatrix_model(case)` and the matrices `seeded_imatrix(model)` of tests/gguf_mixes.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gguf_mixes import IMATRIX_CASES, IMATRIX_FTYPES, imatrix_model, seeded_imatrix  # noqa: E402
from make_llama_quantize_mixes import _tensors  # noqa: E402
from tiny_tokenizer import save_tiny_tokenizer  # noqa: E402


def main(quantize: str) -> None:
    import jaxtune
    from transformers import AutoTokenizer

    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_tokenizer(os.path.join(tmp, "tok"))
        tok = AutoTokenizer.from_pretrained(os.path.join(tmp, "tok"))
        for case in IMATRIX_CASES:
            model = imatrix_model(case, len(tok))
            f32, imatrix = os.path.join(tmp, f"{case}-f32.gguf"), os.path.join(tmp, f"{case}-imatrix.gguf")
            jaxtune.save_gguf(model, f32, tokenizer=tok, gguf_type="f32")
            seeded_imatrix(model).save(imatrix)
            out[case] = {"types": {}, "sha256": {}}
            for ftype in IMATRIX_FTYPES:
                path = os.path.join(tmp, f"{case}-{ftype}.gguf")
                subprocess.run([quantize, "--imatrix", imatrix, f32, path, ftype.upper()], check=True,
                               capture_output=True)
                tensors = _tensors(path)
                out[case]["types"][ftype] = {name: ty for name, (ty, _) in tensors.items()}
                out[case]["sha256"][ftype] = {name: digest for name, (_, digest) in tensors.items()}
                os.remove(path)
    release = [part for part in os.path.abspath(quantize).split(os.sep) if part.startswith("llama_cpp_python-")]
    out["_source"] = {"llama_quantize": f"llama.cpp vendored in {release[0] if release else 'an unknown release'}"}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_quantize_imatrix.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1])
