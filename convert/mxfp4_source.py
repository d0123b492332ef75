"""A checkpoint with MXFP4 tensors (gpt-oss's published experts: `X_blocks` and `X_scales` for each fused expert
tensor `X`) seen as the hub's dequantized layout: one bf16 tensor `X` of the transposed shape `[E, in, out]`, so the
loader, merged export and `jaxtune convert` read both layouts alike."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxtune.errors import CheckpointError
from jaxtune.quant import mxfp4

BLOCKS, SCALES = "_blocks", "_scales"


class Mxfp4Source:
    """Wraps a tensor source; every `X_blocks` / `X_scales` pair becomes `X`, dequantized when read."""

    def __init__(self, source):
        self.source = source
        names = set(source.names())
        self._pairs: dict[str, str] = {}
        for name in names:
            if not name.endswith(BLOCKS):
                continue
            base = name.removesuffix(BLOCKS)
            if base + SCALES not in names:
                raise CheckpointError(f"MXFP4 tensor {name} has no {base + SCALES} beside it; the checkpoint is "
                                      "incomplete: download it again")
            blocks, scales = source.shape(name), source.shape(base + SCALES)
            if len(blocks) != 4 or blocks[-1] != mxfp4.BLOCK // 2 or tuple(blocks[:-1]) != tuple(scales):
                raise CheckpointError(f"MXFP4 tensors {name} {tuple(blocks)} and {base + SCALES} {tuple(scales)} do "
                                      f"not pair ([E, out, groups, {mxfp4.BLOCK // 2}] and [E, out, groups]); the "
                                      "checkpoint is corrupt")
            self._pairs[base] = name
        orphans = sorted(n for n in names if n.endswith(SCALES) and n.removesuffix(SCALES) not in self._pairs)
        if orphans:
            raise CheckpointError(f"MXFP4 tensor {orphans[0]} has no {orphans[0].removesuffix(SCALES) + BLOCKS} "
                                  "beside it; the checkpoint is incomplete: download it again")
        hidden = {p + s for p in self._pairs for s in (BLOCKS, SCALES)}
        self._names = [n for n in source.names() if n not in hidden] + sorted(self._pairs)

    def __enter__(self) -> "Mxfp4Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.source.close()

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._pairs:
            return tuple(self.source.shape(name))
        experts, out, groups, _ = self.source.shape(self._pairs[name])
        return experts, groups * mxfp4.BLOCK, out

    def get(self, name: str) -> np.ndarray:
        """The tensor; an MXFP4 pair dequantized to bf16 [E, in, out] (the hub's dequantized layout)."""
        if name not in self._pairs:
            return self.source.get(name)
        blocks = self.source.get(self._pairs[name])
        scales = self.source.get(name + SCALES)
        return np.swapaxes(mxfp4.dequantize(blocks, scales), -1, -2)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self._names:
            yield name, self.get(name)


def is_mxfp4(quantization_config: dict | None) -> bool:
    """Whether a config.json's quantization_config says its checkpoint stores MXFP4 tensors."""
    return (quantization_config or {}).get("quant_method") == "mxfp4"
