"""Output directories that appear only when complete: write to a temp dir beside them, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from jaxtune.errors import CheckpointError


@contextmanager
def atomic_directory(out_dir: str | os.PathLike) -> Iterator[str]:
    """Yields a temp directory that becomes out_dir on success; on any error it is removed, out_dir never exists."""
    out_dir = os.fspath(out_dir).rstrip("/")
    if os.path.exists(out_dir):
        raise CheckpointError(f"{out_dir} already exists; choose a new output directory or delete it first")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    try:
        yield tmp
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
