"""Tensor-by-tensor reading of Hugging Face safetensors checkpoints (single file or sharded)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxtune.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64, "U8": np.uint8,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
}


def _layout(path: str) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, byte offset in the file) of every numpy-readable tensor of a safetensors file (header
    already validated by safe_open)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    layout = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] not in SAFETENSORS_DTYPES:
            continue
        layout[name] = (np.dtype(SAFETENSORS_DTYPES[info["dtype"]]), tuple(info["shape"]),
                        8 + header_len + info["data_offsets"][0])
    return layout


SINGLE_FILE = "model.safetensors"


def _open(path: str, stack: ExitStack):
    try:
        return stack.enter_context(safe_open(path, framework="numpy"))
    except SafetensorError as e:
        raise CheckpointError(
            f"{path} is truncated or corrupt ({e}); re-download or re-convert the checkpoint"
        ) from None


class SafetensorsSource:
    """Names, shapes and lazily read numpy arrays of every tensor in an HF model directory.

    All headers are opened (and so validated) up front: a truncated file or a shard missing from the
    index fails before any tensor is loaded. Reading is memory-mapped, one tensor at a time.
    """

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = os.fspath(model_dir)
        self._stack = ExitStack()
        index_path = os.path.join(self.model_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map: dict[str, str] = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CheckpointError(f"{index_path} is not a valid safetensors index; restore the file") from None
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(self.model_dir, SINGLE_FILE)):
            files = [SINGLE_FILE]
        else:
            found = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
            if not found:
                raise CheckpointError(
                    f"{self.model_dir} has no *.safetensors weights; convert .bin/.pt checkpoints to safetensors first "
                    "(pickle files are never loaded)"
                )
            files = found
        missing = [f for f in files if not os.path.isfile(os.path.join(self.model_dir, f))]
        if missing:
            raise CheckpointError(
                f"shard {missing[0]} named in {INDEX_FILE} is missing from {self.model_dir}"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; download the complete checkpoint"
            )
        self._handles = {f: _open(os.path.join(self.model_dir, f), self._stack) for f in files}
        self._where: dict[str, str] = {}
        for fname, handle in self._handles.items():
            for key in handle.keys():
                self._where[key] = fname
        self._layouts = {f: _layout(os.path.join(self.model_dir, f)) for f in files}

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._layouts = {}
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped array of its own: the mapping (and the pages it brought into this
        process's resident memory) goes away with the array, so reading a checkpoint tensor by tensor never keeps
        the whole file resident."""
        fname = self._where[name]
        layout = self._layouts[fname].get(name)
        if layout is not None:
            dtype, shape, offset = layout
            if 0 in shape:
                return np.zeros(shape, dtype)
            return np.memmap(os.path.join(self.model_dir, fname), dtype=dtype, mode="r", offset=offset, shape=shape)
        try:  # dtypes numpy cannot view directly
            return self._handles[fname].get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"cannot read tensor {name} from {fname} ({e}); the file is corrupt") from None

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._where:
            yield name, self.get(name)
