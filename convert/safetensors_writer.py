"""Writing sharded safetensors piece by piece, so that no writer holds a whole model in host memory.

safetensors' own `save_file` takes every tensor of a file at once (and copies each into a bytes object). Here the
layout (names, shapes, dtypes) is fixed first: each file's header is written and the file is sized, then tensors,
or single layers of a stacked tensor, are written at their offsets as they are produced, in any order. Files are
read back with safetensors' `safe_open`, which validates the layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from convert.safetensors_source import INDEX_FILE, SAFETENSORS_DTYPES

SHARD_BYTES = 2 * 2**30
_DTYPE_NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}
_MAX_WRITE = 1 << 30  # os.pwrite may write less than asked above ~2 GiB on Linux


def _nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


class SafetensorsFile:
    """One .safetensors file whose tensors are written after its header, each at its offset.

    `specs` are (name, shape, dtype); `write(name, value)` writes a whole tensor and `write(name, value, index=i)`
    its i-th slice along the leading axis (or a [1, ...] slab of it). `close()` checks that every byte was written.
    """

    def __init__(self, path: str, specs: Iterable[tuple[str, Sequence[int], Any]], *, metadata: dict[str, str]):
        self.path = path
        # widest dtype first (as safetensors orders them): every tensor stays aligned to its item size
        ordered = sorted(((n, tuple(int(d) for d in s), np.dtype(t)) for n, s, t in specs),
                         key=lambda spec: (-spec[2].itemsize, spec[0]))
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        self._layout: dict[str, tuple[tuple[int, ...], np.dtype, int]] = {}
        offset = 0
        for name, shape, dtype in ordered:
            if dtype not in _DTYPE_NAMES:
                raise TypeError(f"{name}: dtype {dtype} has no safetensors name")
            end = offset + _nbytes(shape, dtype)
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            self._layout[name] = (shape, dtype, offset)
            offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-(8 + len(encoded)) % 8)  # the data starts 8-byte aligned
        self._data_start = 8 + len(encoded)
        self.nbytes = offset
        # what is written: True for a whole tensor, else one flag per leading index (made on the first slice
        # written: a packed NF4 tensor has millions of rows and must not cost a Python object each)
        self._written: dict[str, bool | np.ndarray] = dict.fromkeys(self._layout, False)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pwrite(len(encoded).to_bytes(8, "little") + encoded, 0)
        os.ftruncate(self._fd, self._data_start + offset)

    def names(self) -> list[str]:
        return list(self._layout)

    def _pwrite(self, data: Any, offset: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            done = os.pwrite(self._fd, view[:_MAX_WRITE], offset)
            view, offset = view[done:], offset + done

    def write(self, name: str, value: Any, index: int | tuple[int, ...] | None = None) -> None:
        """Writes tensor `name`, or one slab of it: `index` picks it along the leading axis (a layer) or axes (a
        layer and an expert)."""
        shape, dtype, start = self._layout[name]
        value = np.ascontiguousarray(np.asarray(value).astype(dtype, copy=False))
        lead = 0 if index is None else 1 if isinstance(index, (int, np.integer)) else len(index)
        want = shape[lead:]
        while index is not None and value.ndim > len(want) and value.shape[0] == 1:  # a slab with unit leading
            value = value[0]  # axes, as dynamic updates take it
        if value.shape != want:
            raise ValueError(f"{name}{'' if index is None else f'[{index}]'}: shape {value.shape}, expected {want}")
        if index is None:
            self._written[name] = True
        else:
            slabs = int(np.prod(shape[:lead]))
            if not all(0 <= i < n for i, n in zip(np.atleast_1d(index), shape[:lead])):
                axes = f"axis of {shape[0]}" if lead == 1 else f"axes of {tuple(shape[:lead])}"
                raise IndexError(f"{name}: index {index} outside the leading {axes}")
            flat = int(np.ravel_multi_index(tuple(np.atleast_1d(index)), shape[:lead]))
            start += flat * value.nbytes
            flags = self._written[name]
            if flags is False:
                flags = self._written[name] = np.zeros(slabs, bool)
            if flags is not True:
                flags[flat] = True
        if value.nbytes:
            self._pwrite(value.reshape(-1).view(np.uint8), self._data_start + start)

    def missing(self) -> list[str]:
        return [name for name, done in self._written.items() if not np.all(done)]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class ShardedSafetensorsWriter:
    """HF's sharded layout (model-0000i-of-0000n.safetensors + index), planned from (name, shape, dtype) specs in
    order, at most `shard_bytes` per file (a larger tensor gets a file of its own). As a context manager it
    finishes on success and only closes on an error (the caller's temporary directory then goes)."""

    def __init__(self, directory: str, specs: Iterable[tuple[str, Sequence[int], Any]], *, metadata: dict[str, str],
                 shard_bytes: int | None = None):
        shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
        groups: list[list[tuple[str, Sequence[int], Any]]] = [[]]
        size = 0
        for spec in specs:
            nbytes = _nbytes(spec[1], spec[2])
            if groups[-1] and size + nbytes > shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(spec)
            size += nbytes
        self.directory, self.metadata = directory, dict(metadata)
        self._files: list[SafetensorsFile] = []
        self._file_of: dict[str, SafetensorsFile] = {}
        try:
            for i, group in enumerate(groups):
                fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                f = SafetensorsFile(os.path.join(directory, fname), group, metadata=metadata)
                self._files.append(f)
                self._file_of.update({name: f for name in f.names()})
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "ShardedSafetensorsWriter":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Finishes (index included) when the block completed, else only closes the files."""
        if exc_type is None:
            self.finish()
        else:
            self.close()

    def write(self, name: str, value: Any, index: int | tuple[int, ...] | None = None) -> None:
        self._file_of[name].write(name, value, index)

    def close(self) -> None:
        for f in self._files:
            f.close()

    def finish(self) -> None:
        """Closes the files and writes the index; every tensor (every layer of a stacked one) must be written."""
        self.close()
        missing = [name for f in self._files for name in f.missing()]
        if missing:
            raise RuntimeError(f"{len(missing)} tensor(s) were never written, e.g. {missing[0]}")
        write_index(self.directory, {name: os.path.basename(f.path) for name, f in self._file_of.items()},
                    self.metadata, total_size=sum(f.nbytes for f in self._files))


def write_index(directory: str, weight_map: dict[str, str], metadata: dict[str, str], *, total_size: int) -> None:
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {**metadata, "total_size": total_size}, "weight_map": weight_map}, f, indent=1)


def write_shards(directory: str, tensors: Iterable[tuple[str, Any]], *, metadata: dict[str, str],
                 shard_bytes: int | None = None) -> None:
    """Writes (name, array) pairs as they come into model-0000i-of-0000n.safetensors files of at most `shard_bytes`
    (a larger tensor gets a file of its own) and their index. Host memory holds at most one shard's tensors."""
    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
    pending: dict[str, np.ndarray] = {}
    written: list[tuple[str, list[str]]] = []
    total = 0

    def flush() -> None:
        nonlocal total
        part = os.path.join(directory, f".shard-{len(written):05d}.partial")
        f = SafetensorsFile(part, [(k, v.shape, v.dtype) for k, v in pending.items()], metadata=metadata)
        try:
            for k, v in pending.items():
                f.write(k, v)
        finally:
            f.close()
        written.append((part, list(pending)))
        total += f.nbytes
        pending.clear()

    size = 0
    for name, value in tensors:
        value = np.asarray(value)
        if pending and size + value.nbytes > shard_bytes:
            flush()
            size = 0
        pending[name] = value
        size += value.nbytes
    if pending or not written:
        flush()
    weight_map: dict[str, str] = {}
    for i, (part, names) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.rename(part, os.path.join(directory, fname))
        weight_map.update({name: fname for name in names})
    write_index(directory, weight_map, metadata, total_size=total)
