"""Deterministic batches from packed rows: order from a seed, position saved with checkpoints."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from jaxtune.data.packing import PackedRows
from jaxtune.data.sources import DataError


class BatchStream:
    """Yields {input_ids, labels, segment_ids, positions, ...the rows' extra arrays} of shape [accum, micro_batch, ...],
    epoch after epoch.

    Each epoch visits the rows in a permutation drawn from (seed, epoch); a partial last batch is dropped.
    A dataset smaller than one step fills each step from the following epochs (with a warning), so a small
    dataset still trains. `state()` / `restore()` make the position part of a checkpoint, so a resumed run
    sees the same batches.
    """

    def __init__(self, rows: PackedRows, *, micro_batch: int, accum: int = 1, seed: int = 0):
        self.rows, self.micro_batch, self.accum, self.seed = rows, micro_batch, accum, seed
        if not len(rows):
            raise DataError("the dataset packs into 0 rows; it needs at least one example with tokens")
        if len(rows) < self.rows_per_step:
            warnings.warn(
                f"the dataset packs into {len(rows)} rows but one step takes {self.rows_per_step} "
                f"(micro_batch {micro_batch} x accumulation {accum}): each step repeats rows from the next epoch",
                stacklevel=2,
            )
        self.epoch, self.position = 0, 0

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.accum

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def _take(self) -> np.ndarray:
        """Row indices of the next step."""
        need = self.rows_per_step
        if need <= len(self.rows):
            if self.position + need > len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
            self.position += need
            return self._order()[self.position - need:self.position]
        parts = []  # fewer rows than a step: whole epochs back to back
        while need:
            if self.position == len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
            n = min(need, len(self.rows) - self.position)
            parts.append(self._order()[self.position:self.position + n])
            self.position, need = self.position + n, need - n
        return np.concatenate(parts)

    def next(self) -> dict[str, np.ndarray]:
        take = self._take()
        shape = (self.accum, self.micro_batch, -1)
        return {k: v[take].reshape(shape) for k, v in self.rows.arrays().items()}

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
