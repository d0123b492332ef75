"""DPO's reference log-probabilities computed once before training (`precompute_reference=True`).

The reference is the model as the run begins (the base model for fresh adapters); its summed response log-probabilities per pair become a
`ref_logps` array [N, 2P] beside the packed rows (chosen, rejected interleaved per pair slot), so each step
runs one forward and backward instead of two forwards and a backward. They are stored in the run directory
(safetensors, with a digest of the rows they belong to) so a resumed run reads them instead of recomputing.
"""

from __future__ import annotations

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxtune.data.packing import IGNORE, PackedRows
from jaxtune.training.compilation import step_compiler_options
from jaxtune.training.config import TrainConfig
from jaxtune.training.objectives import Preference, make_objective
from jaxtune.training.step import OnMesh, to_device_batch

FILE = "reference_logps.safetensors"


def _digest(rows: PackedRows) -> str:
    h = hashlib.sha256()
    for name in ("input_ids", "segment_ids"):
        h.update(np.ascontiguousarray(getattr(rows, name)).tobytes())
    h.update(np.ascontiguousarray(rows.extra["response"]).tobytes())
    return h.hexdigest()


def compute_reference_logps(graphdef: nnx.GraphDef, lora, frozen, rows: PackedRows, micro: int, cfg: TrainConfig,
                            mesh=None, progress: bool = True) -> np.ndarray:
    """[N, 2P] float32: each pair's summed response log-probabilities under the model with adapters `lora` (the
    run's starting adapters: zero, i.e. the base model, unless they were trained before)."""
    objective = make_objective(cfg)
    assert isinstance(objective, Preference)
    pairs = rows.extra["pair_mask"].shape[1]

    def reference(lora, frozen, batch):
        _, (chosen, rejected) = objective.sequence_logps(nnx.merge(graphdef, lora, frozen), batch, None,
                                                         cfg.ce_chunk_size)
        return jnp.stack([chosen, rejected], axis=-1).reshape(chosen.shape[0], 2 * pairs)

    fn = OnMesh(jax.jit(reference, compiler_options=step_compiler_options(compute=cfg.compute)), mesh)
    out = np.zeros((len(rows), 2 * pairs), np.float32)
    arrays = rows.arrays()
    fill = {"labels": IGNORE}
    for start in tqdm(range(0, len(rows), micro), desc="reference log-probs", unit="batch", leave=False,
                      disable=not progress):
        idx = np.arange(start, min(start + micro, len(rows)))
        batch = {k: np.pad(v[idx], ((0, micro - len(idx)),) + ((0, 0),) * (v.ndim - 1),
                           constant_values=fill.get(k, 0)) for k, v in arrays.items()}
        result = np.asarray(jax.device_get(fn(lora, frozen, to_device_batch(batch, mesh))))
        out[idx] = result[:len(idx)]
    return out


def reference_logps(graphdef: nnx.GraphDef, lora, frozen, splits: dict[str, PackedRows], micro: int,
                    cfg: TrainConfig, run_dir: str | None, mesh=None, lead: bool = True,
                    progress: bool = True) -> dict[str, np.ndarray]:
    """`ref_logps` of each split, read from run_dir when stored there for the same rows, else computed (and
    stored, by the lead process)."""
    from safetensors.numpy import load_file, save_file

    path = None if run_dir is None else os.path.join(run_dir, FILE)
    digests = {name: _digest(rows) for name, rows in splits.items()}
    if path is not None and os.path.exists(path):
        from safetensors import safe_open

        with safe_open(path, framework="numpy") as f:
            stored = f.metadata() or {}
        if all(stored.get(name) == digest for name, digest in digests.items()):
            tensors = load_file(path)
            if all(name in tensors for name in splits):
                return {name: tensors[name] for name in splits}
    result = {name: compute_reference_logps(graphdef, lora, frozen, rows, micro, cfg, mesh, progress)
              for name, rows in splits.items()}
    if path is not None and lead:
        tmp = path + ".tmp"
        save_file(result, tmp, metadata=digests)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # safetensors creates it private (0600): as a plain open() would
        os.replace(tmp, path)
    return result
