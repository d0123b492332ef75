"""Filling an abstract NNX state from arrays addressed by path tuples."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

Path = tuple[str, ...]


def expected_arrays(state: nnx.State) -> tuple[dict, dict[Path, jax.ShapeDtypeStruct]]:
    """(pure nested dict, {path: ShapeDtypeStruct}) of an abstract state."""
    pure = nnx.to_pure_dict(state)
    return pure, _flatten(pure)


def merge_filled(graphdef: nnx.GraphDef, state: nnx.State, pure: dict, values: dict[Path, Any]) -> Any:
    """The module whose arrays are `values` (every path of the abstract state must be present)."""
    for path, value in values.items():
        node = pure
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _flatten(tree: dict, prefix: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (str(k),)))
        else:
            out[prefix + (str(k),)] = v
    return out
