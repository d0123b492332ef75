"""Importance matrices for 4-bit GGUF export: computed by jaxtune from text, or read from llama.cpp's imatrix file.

An importance matrix holds, for each projection of each layer, the sum over a calibration text's tokens of the
square of every input column, and the token count (llama.cpp's `llama-imatrix` output). `llama-quantize --imatrix`
and `save_gguf(..., imatrix=...)` quantize each weight with sum / count as its columns' error weights
(jaxtune/quant/weighted.py). jaxtune computes it with the fine-tuned model itself, adapters included, on the data it
was tuned on or any other; it is written and read in llama.cpp's imatrix GGUF layout (`<tensor>.in_sum2`,
`<tensor>.counts`), so either tool can use the other's.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from convert.gguf_source import _LAYER_NAMES
from jaxtune.data.packing import PackedRows
from jaxtune.errors import CheckpointError, UnsupportedModelError
from jaxtune.models import input_stats
from jaxtune.models.causal_lm import CausalLM
from jaxtune.models.layer_kinds import layer_runs
from jaxtune.models.rope import rope_tables
from jaxtune.qlora import PARENT_MODULE

_GGUF_KINDS = {hf: gguf for gguf, hf in _LAYER_NAMES.items()}  # `self_attn.q_proj` -> llama.cpp's `attn_q`


@dataclasses.dataclass
class ImportanceMatrix:
    """Per GGUF tensor name (`blk.0.attn_q.weight`, ...): the input columns' sums of squares [in] and the count of
    tokens summed; with the text's chunk size and count and where it came from, as llama.cpp records them."""

    sums: dict[str, np.ndarray]
    counts: dict[str, int]
    chunk_size: int = 0
    chunk_count: int = 0
    datasets: list[str] = dataclasses.field(default_factory=list)

    def weights(self, name: str) -> np.ndarray | None:
        """The error weights of tensor `name` (sums / count, float32, as llama-quantize divides them), None where
        the matrix has no entry for it."""
        if name not in self.sums:
            return None
        count = np.float32(self.counts[name])
        if count <= 0:
            return np.ones_like(self.sums[name], np.float32)
        return (np.asarray(self.sums[name], np.float32) / count).astype(np.float32)

    def save(self, path: str | os.PathLike) -> None:
        """Writes llama.cpp's imatrix GGUF (what `llama-imatrix` writes and `llama-quantize --imatrix` reads)."""
        import tempfile

        import gguf

        from convert.atomic import plain_permissions

        path = os.fspath(path)
        parent = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
        os.close(fd)
        try:
            writer = gguf.GGUFWriter(tmp, arch="")
            writer.add_type("imatrix")
            writer.add_array("imatrix.datasets", list(self.datasets) or ["jaxtune"])
            writer.add_uint32("imatrix.chunk_count", int(self.chunk_count))
            writer.add_uint32("imatrix.chunk_size", int(self.chunk_size))
            for name in sorted(self.sums):
                writer.add_tensor(f"{name}.in_sum2", np.asarray(self.sums[name], np.float32)[None, :])
                writer.add_tensor(f"{name}.counts", np.asarray([[self.counts[name]]], np.float32))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            plain_permissions(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ImportanceMatrix":
        """Reads llama.cpp's imatrix GGUF; anything else is named in one line."""
        import gguf

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"imatrix file {path} does not exist; pass llama-imatrix's .gguf output or a data "
                                  "file to compute one from")
        try:
            reader = gguf.GGUFReader(path)
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise CheckpointError(f"{path} is not a GGUF file ({type(e).__name__}); pass llama-imatrix's .gguf output "
                                  "(the legacy .dat format is not read)") from None
        tensors = {t.name: t for t in reader.tensors}
        sums, counts = {}, {}
        for name, tensor in tensors.items():
            if not name.endswith(".in_sum2"):
                continue
            base = name[: -len(".in_sum2")]
            count = tensors.get(f"{base}.counts")
            if count is None or tensor.tensor_type != gguf.GGMLQuantizationType.F32:
                raise CheckpointError(f"{path}: {base} has no float32 .in_sum2 / .counts pair; the imatrix is corrupt")
            values, n = np.asarray(tensor.data, np.float32), np.asarray(count.data, np.float32).reshape(-1)
            if n.size != 1:
                raise UnsupportedModelError(f"{path}: {base} holds {n.size} experts' statistics; imatrix export "
                                            "covers dense models")
            sums[base], counts[base] = values.reshape(-1), int(np.rint(n[0]))
        if not sums:
            raise CheckpointError(f"{path} holds no imatrix entries (no <tensor>.in_sum2); is it llama-imatrix's output?")
        field = reader.fields.get("imatrix.chunk_size")
        size = int(field.parts[field.data[0]][0]) if field is not None else 0
        field = reader.fields.get("imatrix.chunk_count")
        chunks = int(field.parts[field.data[0]][0]) if field is not None else 0
        return cls(sums, counts, size, chunks, [])


def check_importance_model(model: CausalLM) -> None:
    """Refuses, in one line, a model whose importance matrix jaxtune does not compute: a hybrid decoder (no GGUF
    export yet) or a mixture of experts."""
    if model.config.layer_types:
        raise UnsupportedModelError(f"GGUF export, and so --gguf-imatrix, does not cover {model.config.model_type} "
                                    "yet; export --merged instead")
    if model.config.num_experts:
        raise UnsupportedModelError(
            "--gguf-imatrix covers dense models; a mixture of experts' per-expert statistics are not computed yet "
            "(pass llama-imatrix's file for a llama.cpp quantization of the merged export instead)")


def compute_importance(model: CausalLM, rows: PackedRows, *, batch_size: int = 4, progress: bool = True,
                       dataset: str = "") -> ImportanceMatrix:
    """The importance matrix of `model` (adapters included) over packed rows: every real token of every row."""
    check_importance_model(model)
    cfg = model.config
    stacks = {run.stack.attr: nnx.split(getattr(model, run.stack.attr)) for run in layer_runs(cfg)}

    def layer_fn(graphdef):
        @jax.jit
        def run(stack_state, index, h, cos, sin, segments):  # the stack's layer `index`, read in place
            layer = nnx.merge(graphdef, jax.tree.map(lambda a: a[index], stack_state))
            with input_stats.collecting(segments > 0) as got:
                out, _ = layer(h, cos, sin, segments)
            return out, dict(got)

        return run

    runners = {attr: layer_fn(graphdef) for attr, (graphdef, _) in stacks.items()}
    sums: dict[str, np.ndarray] = {}
    tokens = 0
    starts = range(0, len(rows), batch_size)
    for start in tqdm(starts, desc="importance matrix", unit="batch", leave=False, disable=not progress):
        ids, segments = (jnp.asarray(a[start:start + batch_size]) for a in (rows.input_ids, rows.segment_ids))
        positions = jnp.asarray(rows.positions[start:start + batch_size])
        h = model.embed_tokens(ids).astype(model.dtype)
        cos, sin = rope_tables(cfg, positions)
        tokens += int((rows.segment_ids[start:start + batch_size] > 0).sum())
        for run in layer_runs(cfg):
            _, state = stacks[run.stack.attr]
            for j in range(run.start, run.start + run.count):
                h, got = runners[run.stack.attr](state, jnp.int32(j), h, cos, sin, segments)
                layer = run.first + j - run.start
                for proj, value in got.items():
                    name = f"blk.{layer}.{_GGUF_KINDS[f'{PARENT_MODULE[proj]}.{proj}']}.weight"
                    sums[name] = sums.get(name, 0) + np.asarray(value, np.float64)
    if not tokens:
        raise CheckpointError("the importance data has no tokens; pass rows of text")
    chunk = rows.input_ids.shape[1]
    return ImportanceMatrix({k: v.astype(np.float32) for k, v in sums.items()}, {k: tokens for k in sums}, chunk,
                            len(rows), [dataset] if dataset else [])


def importance_source(source: str | os.PathLike, fmt: str) -> ImportanceMatrix | tuple[str, list]:
    """What `source` holds, read and checked before any model loads: llama.cpp's imatrix .gguf, or a data file's
    rows of `fmt` (returned with its name) to run the model over."""
    from jaxtune.data.formats import check_rows
    from jaxtune.data.sources import read_rows

    source = os.fspath(source)
    if source.endswith(".gguf"):
        return ImportanceMatrix.load(source)
    rows = read_rows(source)
    check_rows(rows, fmt)
    return os.path.basename(source), rows


def importance_from(model: CausalLM, tokenizer: Any, source, *, fmt: str = "text", seq_len: int = 512,
                    progress: bool = True) -> ImportanceMatrix:
    """An importance matrix from `source` (a path, or what `importance_source` read of one): llama.cpp's imatrix
    as it is, or a data file's rows of `fmt` (every token counted, packed into rows of `seq_len`) run through the
    model."""
    from jaxtune.data.formats import encode_rows
    from jaxtune.data.packing import pack_examples

    if not isinstance(source, (ImportanceMatrix, tuple)):
        source = importance_source(source, fmt)
    if isinstance(source, ImportanceMatrix):
        return source
    check_importance_model(model)
    name, rows = source
    examples = encode_rows(rows, fmt, tokenizer, train_on_all=True, progress=progress)
    return compute_importance(model, pack_examples(examples, seq_len), progress=progress, dataset=name)
