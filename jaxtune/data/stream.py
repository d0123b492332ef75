"""Deterministic batches from packed rows: order from a seed, position saved with checkpoints."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxtune.data.packing import PackedRows
from jaxtune.data.sources import DataError


class BatchStream:
    """Yields {input_ids, labels, segment_ids, positions} of shape [accum, micro_batch, T], epoch after epoch.

    Each epoch visits the rows in a permutation drawn from (seed, epoch); a partial last batch is dropped.
    `state()` / `restore()` make the position part of a checkpoint, so a resumed run sees the same batches.
    """

    def __init__(self, rows: PackedRows, *, micro_batch: int, accum: int = 1, seed: int = 0):
        self.rows, self.micro_batch, self.accum, self.seed = rows, micro_batch, accum, seed
        if len(rows) < self.rows_per_step:
            raise DataError(
                f"the dataset packs into {len(rows)} rows but one step needs {self.rows_per_step} "
                f"(micro_batch {micro_batch} x accumulation {accum}); lower the batch size or add data"
            )
        self.epoch, self.position = 0, 0

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.accum

    def _order(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.rows))

    def next(self) -> dict[str, np.ndarray]:
        if self.position + self.rows_per_step > len(self.rows):
            self.epoch, self.position = self.epoch + 1, 0
        take = self._order()[self.position:self.position + self.rows_per_step]
        self.position += self.rows_per_step
        shape = (self.accum, self.micro_batch, -1)
        return {
            "input_ids": self.rows.input_ids[take].reshape(shape),
            "labels": self.rows.labels[take].reshape(shape),
            "segment_ids": self.rows.segment_ids[take].reshape(shape),
            "positions": self.rows.positions[take].reshape(shape),
        }

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def restore(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
