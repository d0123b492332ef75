"""Exporting a training run (RUN directory): its base model with the LoRA adapters of the latest checkpoint."""

from __future__ import annotations

import os
from typing import Any

from jaxtune.errors import CheckpointError
from jaxtune.io.jsonfile import read_json_file
from jaxtune.models.causal_lm import CausalLM


def _read_run(run_dir: str) -> tuple[str, dict[str, Any]]:
    """(the run's config.json path, its contents) as `jaxtune train` wrote them, with the base model recorded."""
    path = os.path.join(run_dir, "config.json")
    saved = read_json_file(path, missing=f"{run_dir} is not a training run directory (no config.json); "
                                         "pass the --out of jaxtune train")
    if not saved.get("base_model"):
        raise CheckpointError(f"{path} does not record the base model; export with jaxtune.save_peft from Python")
    return path, saved


def run_data_settings(run_dir: str | os.PathLike) -> tuple[str, int]:
    """(data format, sequence length) the run trained with: how a data file of the same kind is read."""
    from jaxtune.training.config import TrainConfig

    path, saved = _read_run(os.fspath(run_dir))
    cfg = TrainConfig.from_dict(saved["train"], where=path)
    return cfg.format, cfg.seq_len


def check_run_exportable(run_dir: str | os.PathLike, *, gguf: bool, merged_dtype: str | None) -> None:
    """Refuses, before any weight is read, an export the run's model cannot make (a GGUF of an architecture
    llama.cpp's writer here does not cover, a mixture of experts' NF4 merged checkpoint, PEFT or merged export of a
    layout not written yet): only its config is opened."""
    check_model_exportable(_read_run(os.fspath(run_dir))[1]["base_model"], gguf=gguf, merged_dtype=merged_dtype,
                           adapters=True)


def check_model_exportable(model: str, *, gguf: bool, merged_dtype: str | None, adapters: bool = False) -> None:
    """`check_run_exportable` for a model itself (exported without adapters unless `adapters`): HF directory,
    .gguf, jaxtune checkpoint, bundled name or hub id."""
    from convert.load import open_checkpoint
    from jaxtune.io.bundled import resolve_model_path

    if not gguf and merged_dtype is None and not adapters:
        return
    cfg, source, _ = open_checkpoint(resolve_model_path(model))
    source.close()
    if gguf:
        from convert.gguf_export import check_gguf_model

        check_gguf_model(cfg)
    if merged_dtype == "nf4":
        cfg.require_dense("exporting a merged NF4 checkpoint (use a 16-bit dtype)")


def load_run(run_dir: str | os.PathLike, *, dtype: str = "float32") -> tuple[CausalLM, Any, str]:
    """(model with the run's trained adapters, tokenizer, base model path) from a `jaxtune train` RUN dir."""
    from convert.load import from_pretrained
    from jaxtune.qlora import get_peft_model
    from jaxtune.training.checkpoint import RunCheckpoints
    from jaxtune.training.config import TrainConfig
    from jaxtune.training.step import make_optimizer, split_model

    run_dir = os.fspath(run_dir)
    path, saved = _read_run(run_dir)
    base_model = saved["base_model"]
    cfg = TrainConfig.from_dict(saved["train"], where=path)
    ckpts = RunCheckpoints(run_dir)
    try:
        if ckpts.latest_step() is None:
            raise CheckpointError(f"{run_dir} has no checkpoint yet; train at least one step first")
        model, tokenizer = from_pretrained(base_model, dtype=dtype, load_in_4bit=True)
        get_peft_model(model, r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                       target_modules=cfg.target_modules, use_rslora=cfg.use_rslora, seed=cfg.seed)
        from flax import nnx

        _, lora, _ = split_model(model)
        opt_state = make_optimizer(cfg).init(lora)
        lora, _, _ = ckpts.restore(lora, opt_state)
        nnx.update(model, lora)
    finally:
        ckpts.close()
    return model, tokenizer, base_model


def original_weights(base_model: str) -> str | None:
    """Where the run's original (not NF4-quantized) weights are: the base model itself when it is an unquantized
    HF directory, a .gguf (a bundled model's included) or a hub id of either, the checkpoint a jaxtune conversion
    was made from when that still exists, else None."""
    from convert.jaxtune_format import converted_from, is_jaxtune_checkpoint
    from convert.load import bnb_quantization
    from jaxtune.io.bundled import resolve_model_path

    try:  # a bundled name (its GGUF is the original) or a hub id (its cached copy)
        base_model = resolve_model_path(base_model)
    except CheckpointError:
        return None
    if os.path.isfile(base_model) and base_model.endswith(".gguf"):
        return base_model
    if not (os.path.isdir(base_model) and os.path.isfile(os.path.join(base_model, "config.json"))):
        return None
    if is_jaxtune_checkpoint(base_model):
        source = converted_from(base_model)
        return original_weights(source) if source and not is_jaxtune_checkpoint(source) else None
    return None if bnb_quantization(base_model) else base_model
