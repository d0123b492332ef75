"""The held-out split's metrics at an evaluation step: the loss and the objective's metrics, and with
`eval_quantized` the loss through that 4-bit format's quantizer (the export's rounding of the merged weights)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxtune.data import PackedRows
from jaxtune.data.packing import IGNORE
from jaxtune.training.step import to_device_batch


def held_out_means(eval_fn, lora, frozen, rows: PackedRows, micro: int, mesh=None) -> tuple[float, dict[str, float]]:
    """(mean loss, mean metrics) over the held-out rows: token-weighted (SFT) or pair-weighted (DPO/ORPO). Every
    batch has `micro` rows (the last one padded with rows that carry no loss), so one compiled evaluation serves the
    run: a shorter last batch would compile a second one."""
    total, count, metric_totals = 0.0, 0.0, {}
    arrays = rows.arrays()
    for start in range(0, len(rows), micro):
        idx = np.arange(start, min(start + micro, len(rows)))
        batch = {k: v[idx][None] for k, v in arrays.items()}
        if len(idx) < micro:  # the last batch, padded with rows that carry no loss
            fill = {"labels": IGNORE, "segment_ids": 0}
            batch = {k: np.pad(v, ((0, 0), (0, micro - len(idx))) + ((0, 0),) * (v.ndim - 2),
                               constant_values=fill.get(k, 0)) for k, v in batch.items()}
        s, metrics, n = jax.device_get(eval_fn(lora, frozen, to_device_batch(batch, mesh)))
        total, count = total + float(s), count + float(n)
        for k, v in metrics.items():
            metric_totals[k] = metric_totals.get(k, 0.0) + float(v)
    count = max(count, 1.0)
    return total / count, {k: v / count for k, v in metric_totals.items()}


@dataclasses.dataclass
class HeldOutEval:
    """The compiled evaluations of a run's held-out rows. `quantized`: the 4-bit format of `eval_quantized` (None:
    off); `quantized_fn`: its evaluation, None when the run's own (under QAT of that format) already is it."""

    eval_fn: Callable
    rows: PackedRows
    quantized: str | None = None
    quantized_fn: Callable | None = None

    def record(self, lora, frozen, micro: int, mesh=None) -> dict[str, float]:
        """eval_loss, eval_<metric>, and eval_loss_<format> with `eval_quantized`."""
        loss, metrics = held_out_means(self.eval_fn, lora, frozen, self.rows, micro, mesh)
        out = {"eval_loss": loss, **{f"eval_{k}": v for k, v in metrics.items()}}
        if self.quantized is not None:
            out[f"eval_loss_{self.quantized}"] = loss if self.quantized_fn is None else (
                held_out_means(self.quantized_fn, lora, frozen, self.rows, micro, mesh)[0])
        return out
