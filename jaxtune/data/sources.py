"""Reading rows from local files: JSONL, JSON, CSV, Parquet, and `datasets` datasets saved to disk."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from typing import Any

from jaxtune.errors import JaxtuneError


class DataError(JaxtuneError, ValueError):
    """A dataset file or row is unusable; the message names the file, the row and the field."""


@dataclass(frozen=True)
class Row:
    data: dict[str, Any]
    where: str  # "file:line" (or "file:row N") for error messages


def read_rows(path: str | os.PathLike) -> list[Row]:
    """All rows of a local dataset file or saved `datasets` directory, with their locations."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"dataset {path} does not exist; pass a .jsonl, .json, .csv or .parquet file")
    if os.path.isdir(path):
        return _read_saved_dataset(path)
    ext = os.path.splitext(path)[1].lower()
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".parquet": _read_parquet}
    if ext not in readers:
        raise DataError(f"unsupported dataset file type {ext or path!r}; use .jsonl, .json, .csv, .parquet or a saved datasets dir")
    rows = readers[ext](path)
    if not rows:
        raise DataError(f"dataset {path} is empty; it needs at least one row")
    return rows


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object per row, got {type(value).__name__}")
    return value


def _read_jsonl(path: str) -> list[Row]:
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: invalid JSON ({e.msg}); fix or remove that line") from None
            rows.append(Row(_object(value, where), where))
    return rows


def _read_json(path: str) -> list[Row]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        raise DataError(f"{path}: expected a JSON list of objects (or {{\"data\": [...]}})")
    return [Row(_object(v, f"{path}:row {i}"), f"{path}:row {i}") for i, v in enumerate(value)]


def _read_csv(path: str) -> list[Row]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        return [Row(dict(r), f"{path}:{reader.line_num}") for r in reader]


def _read_parquet(path: str) -> list[Row]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError on bad files
        raise DataError(f"{path} is not a readable Parquet file ({e})") from None
    return [Row(r, f"{path}:row {i}") for i, r in enumerate(table.to_pylist())]


def _read_saved_dataset(path: str) -> list[Row]:
    if not any(os.path.exists(os.path.join(path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise DataError(f"{path} is a directory but not a dataset saved with datasets' save_to_disk")
    try:
        import datasets
    except ImportError:
        raise DataError("reading a saved dataset directory needs the datasets package: pip install datasets") from None
    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    rows = [Row(r, f"{path}:row {i}") for i, r in enumerate(ds)]
    if not rows:
        raise DataError(f"dataset {path} is empty; it needs at least one row")
    return rows
