"""Output directories that appear only when complete: write to a temp dir beside them, then rename."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from jaxtune.errors import CheckpointError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def plain_permissions(path: str | os.PathLike) -> None:
    """Gives `path` (and, for a directory, everything in it) the permissions a plain `open()` / `mkdir()` would
    under the umask: temp files and dirs (and safetensors' files) are created private, 0600 / 0700, which would keep
    another user or a service (Ollama, a model server) from reading the output."""
    mask = _umask()
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)
    if os.path.isdir(path):
        for root, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777 & ~mask)
            for f in files:
                os.chmod(os.path.join(root, f), 0o666 & ~mask)


def check_writable(out: str | os.PathLike, what: str = "output") -> None:
    """Refuses, before any work, an output whose directory cannot be written (a read-only mount, another user's):
    it tries to create a file there, as the write itself would."""
    existing = os.path.dirname(os.path.abspath(os.fspath(out)))
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxtune-write-check-", dir=existing)
    except OSError as e:
        raise CheckpointError(f"cannot write the {what} {os.fspath(out)}: {existing} is not writable "
                              f"({e.strerror}); choose another output path") from None
    os.close(fd)
    os.remove(probe)


@contextmanager
def atomic_directory(out_dir: str | os.PathLike) -> Iterator[str]:
    """Yields a temp directory that becomes out_dir on success; on any error it is removed, out_dir never exists."""
    out_dir = os.fspath(out_dir).rstrip("/")
    if os.path.exists(out_dir):
        raise CheckpointError(f"{out_dir} already exists; choose a new output directory or delete it first")
    check_writable(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    try:
        yield tmp
        plain_permissions(tmp)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
