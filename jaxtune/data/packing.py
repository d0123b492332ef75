"""Sample packing: first-fit-decreasing into fixed-length rows with segment ids and per-sample positions."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxtune.data.formats import Example

IGNORE = -1  # label of positions the loss skips


@dataclass
class PackedRows:
    """Rows of length T: input_ids, labels (IGNORE where no loss), segment_ids (0 = padding), positions."""

    input_ids: np.ndarray  # int32 [N, T]
    labels: np.ndarray  # int32 [N, T]
    segment_ids: np.ndarray  # int32 [N, T]
    positions: np.ndarray  # int32 [N, T]
    truncated: int  # examples cut to T
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # more per-row arrays [N, ...] (preference pairs)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every per-row array by name: what a batch of these rows holds."""
        return {"input_ids": self.input_ids, "labels": self.labels, "segment_ids": self.segment_ids,
                "positions": self.positions, **self.extra}

    @property
    def efficiency(self) -> float:
        """Fraction of row slots that hold real tokens."""
        return float((self.segment_ids > 0).mean()) if self.segment_ids.size else 0.0

    def __len__(self) -> int:
        return self.input_ids.shape[0]


class _FirstFit:
    """Leftmost bin with at least `need` free slots, in O(log bins) via a max segment tree."""

    def __init__(self, capacity: int, max_bins: int):
        self.capacity, self.size = capacity, 1
        while self.size < max_bins:
            self.size *= 2
        self.tree = np.zeros(2 * self.size, np.int64)
        self.bins = 0

    def _update(self, i: int, free: int) -> None:
        i += self.size
        self.tree[i] = free
        while i > 1:
            i //= 2
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def place(self, need: int) -> int:
        if self.tree[1] < need:  # no open bin fits: open a new one
            b = self.bins
            self.bins += 1
            self._update(b, self.capacity - need)
            return b
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= need else 2 * i + 1
        b = i - self.size
        self._update(b, self.tree[i] - need)
        return b


def _assemble(bins: list[list[Example]], seq_len: int, truncated: int) -> PackedRows:
    n = len(bins)
    ids = np.zeros((n, seq_len), np.int32)
    labels = np.full((n, seq_len), IGNORE, np.int32)
    seg = np.zeros((n, seq_len), np.int32)
    pos = np.zeros((n, seq_len), np.int32)
    for r, row in enumerate(bins):
        at = 0
        for s, ex in enumerate(row, start=1):
            k = len(ex.ids)
            ids[r, at:at + k] = ex.ids
            seg[r, at:at + k] = s
            pos[r, at:at + k] = np.arange(k)
            # position j predicts token j+1 of the same sample; the last token of a sample predicts nothing
            labels[r, at:at + k - 1] = np.where(ex.target[1:], ex.ids[1:], IGNORE)
            at += k
    return PackedRows(ids, labels, seg, pos, truncated)


def _truncate(examples: Sequence[Example], seq_len: int) -> tuple[list[Example], int]:
    out, cut = [], 0
    for ex in examples:
        if len(ex.ids) > seq_len:
            ex, cut = Example(ex.ids[:seq_len], ex.target[:seq_len]), cut + 1
        out.append(ex)
    if cut:
        warnings.warn(f"{cut} of {len(examples)} examples were longer than seq_len={seq_len} and were truncated",
                      stacklevel=3)
    return out, cut


def pack_examples(examples: Sequence[Example], seq_len: int, *, packing: bool = True) -> PackedRows:
    """First-fit-decreasing packing into rows of seq_len (or one padded example per row without packing)."""
    examples, cut = _truncate(examples, seq_len)
    if not packing:
        return _assemble([[ex] for ex in examples], seq_len, cut)
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].ids), i))
    fit = _FirstFit(seq_len, max(1, len(examples)))
    bins: list[list[Example]] = []
    for i in order:
        b = fit.place(len(examples[i].ids))
        if b == len(bins):
            bins.append([])
        bins[b].append(examples[i])
    return _assemble(bins, seq_len, cut)
