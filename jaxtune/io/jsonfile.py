"""Reading the JSON files of checkpoints and runs, with one-line errors that say what to do."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxtune.errors import CheckpointError


def read_json_file(path: str | os.PathLike, *, missing: str) -> Any:
    """Parsed JSON of `path`; `missing` is the error message used when the file does not exist."""
    if not os.path.isfile(path):
        raise CheckpointError(missing)
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); restore or re-create the file") from None
