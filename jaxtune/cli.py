"""The `jaxtune` command line: one subcommand per job; user errors print one line and exit 1."""

from __future__ import annotations

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    """argparse with jaxtune's error form: one `jaxtune: error: ...` line (no usage block), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"jaxtune: error: {self.prog}: {message}; see {self.prog} --help\n")


def _generate(args: argparse.Namespace) -> None:
    from jaxtune.io.bundled import check_model_reference
    from jaxtune.errors import CheckpointError, ConfigError
    from jaxtune.generate import check_sampling

    check_sampling(args.max_new_tokens, args.temperature, args.top_p)  # before the model loads
    if any(not p for p in args.prompt):
        raise ConfigError("--prompt is empty; pass the text to continue")
    check_model_reference(args.model)
    if args.adapter and not os.path.isdir(args.adapter):
        raise CheckpointError(f"--adapter {args.adapter} is not a directory; pass a PEFT adapter directory "
                              "(from jaxtune export --peft)")
    import jaxtune

    model, tokenizer = jaxtune.from_pretrained(args.model, dtype=args.dtype, load_in_4bit=args.load_in_4bit)
    if tokenizer is None:
        raise jaxtune.CheckpointError(f"{args.model} has no tokenizer files; add tokenizer.json to the model directory")
    if args.adapter:
        jaxtune.load_peft(model, args.adapter)
    chat = not args.raw and getattr(tokenizer, "chat_template", None)
    prompts = [[{"role": "user", "content": p}] if chat else p for p in args.prompt]
    outputs = jaxtune.generate(
        model, tokenizer, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p, seed=args.seed,
    )
    for prompt, out in zip(args.prompt, outputs):
        if len(args.prompt) > 1:
            print(f">>> {prompt}")
        print(out)


def _convert(args: argparse.Namespace) -> None:
    from convert.convert import convert

    seconds = convert(args.src, args.dst, quantize=args.quantize, dtype=args.dtype)
    print(f"wrote {args.dst} ({args.quantize}) in {seconds:.1f} s")


def _export(args: argparse.Namespace) -> None:
    from convert.export import check_model_exportable, check_run_exportable, load_run, original_weights
    from convert.merged import save_merged
    from convert.peft_io import save_peft
    from jaxtune.errors import CheckpointError

    if (args.run is None) == (args.model is None):
        raise CheckpointError("export needs a training run (RUN, the --out of jaxtune train) or --model MODEL (the "
                              "model itself, without adapters): pass one of them")
    if not args.peft and not args.merged and not args.gguf:
        raise CheckpointError("nothing to export: pass --peft DIR, --merged DIR and/or --gguf OUT.gguf")
    if args.model is not None and args.peft:
        raise CheckpointError("--peft writes a run's trained adapters, and --model has none: pass the run "
                              "directory instead, or only --merged / --gguf")
    from convert.atomic import check_writable

    for out in filter(None, (args.peft, args.merged)):  # refuse before writing anything
        if os.path.exists(out):
            raise CheckpointError(f"{out} already exists; choose a new output directory or delete it first")
        check_writable(out, "output directory")
    if args.gguf:
        from convert.gguf_export import check_gguf_output

        check_gguf_output(args.gguf)
    importance = _imatrix_source(args) if args.gguf_imatrix is not None else None
    merged_dtype = args.dtype if args.merged else None
    if args.model is not None:
        from jaxtune.io.bundled import check_model_reference

        check_model_reference(args.model)
        check_model_exportable(args.model, gguf=bool(args.gguf), merged_dtype=merged_dtype)
        from convert.load import from_pretrained

        # its weights are read again from the file as each tensor is written; the 4-bit copy keeps memory low
        base_model = args.model
        model, tokenizer = from_pretrained(base_model, load_in_4bit=True)
    else:
        check_run_exportable(args.run, gguf=bool(args.gguf), merged_dtype=merged_dtype)
        model, tokenizer, base_model = load_run(args.run)
    base = args.base or original_weights(base_model)
    onto = "onto " + base if base else "onto dequantized NF4 weights"
    if args.peft:
        save_peft(model, args.peft, base_model_name_or_path=base_model)
        print(f"wrote PEFT adapter {args.peft}")
    if args.merged:
        save_merged(model, args.merged, base=base, tokenizer=tokenizer, dtype=args.dtype)
        print(f"wrote merged checkpoint {args.merged} ({onto})")
    if args.gguf:
        from convert.gguf_export import save_gguf

        imatrix = None
        if importance is not None:
            from convert.imatrix import importance_from

            source, fmt, seq_len = importance
            imatrix = importance_from(model, tokenizer, source, fmt=fmt, seq_len=seq_len)
        save_gguf(model, args.gguf, tokenizer=tokenizer, base=base, gguf_type=args.gguf_type, imatrix=imatrix)
        weighted = f", weighted by the importance matrix of {args.gguf_imatrix}" if imatrix is not None else ""
        print(f"wrote GGUF {args.gguf} ({args.gguf_type}, {onto}{weighted})")


def _imatrix_source(args: argparse.Namespace):
    """(what --gguf-imatrix holds, its rows' format, the sequence length they pack to), read and checked before any
    model loads: an export that cannot use it, a missing or corrupt imatrix, a malformed row are refused here."""
    from convert.export import run_data_settings
    from convert.gguf_export import IMATRIX_TYPES
    from convert.imatrix import importance_source
    from jaxtune.errors import CheckpointError

    if not args.gguf:
        raise CheckpointError("--gguf-imatrix weights a GGUF's quantizers: pass --gguf OUT.gguf too")
    if args.gguf_type not in IMATRIX_TYPES:
        raise CheckpointError(f"an importance matrix weights the {', '.join(IMATRIX_TYPES)} quantizers; "
                              f"--gguf-type {args.gguf_type} does not use one")
    if not os.path.isfile(args.gguf_imatrix):
        raise CheckpointError(f"--gguf-imatrix {args.gguf_imatrix} does not exist; pass llama-imatrix's .gguf or "
                              "a data file")
    fmt, seq_len = run_data_settings(args.run) if args.run is not None else ("text", 512)
    fmt = args.gguf_imatrix_format or fmt
    return importance_source(args.gguf_imatrix, fmt), fmt, seq_len


_TRAIN_OVERRIDES = {  # CLI flag -> TrainConfig field
    "format": "format", "max_steps": "max_steps", "seq_len": "seq_len", "batch_size": "micro_batch_size",
    "grad_accum": "grad_accum", "lr": "learning_rate", "schedule": "schedule", "warmup_steps": "warmup_steps",
    "lora_r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "remat": "remat",
    "eval_fraction": "eval_fraction", "eval_steps": "eval_steps", "save_steps": "save_steps", "seed": "seed",
    "mesh": "mesh", "compute": "compute", "qat": "qat", "qat_start_step": "qat_start_step",
    "eval_quantized": "eval_quantized", "report_to": "report_to",
    "objective": "objective", "beta": "beta",
    "dpo_loss": "dpo_loss", "label_smoothing": "label_smoothing", "orpo_lambda": "orpo_lambda",
    "num_generations": "num_generations", "max_completion_length": "max_completion_length",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "epsilon": "epsilon",
    "epsilon_high": "epsilon_high", "delta": "delta", "loss_type": "loss_type", "scale_rewards": "scale_rewards",
    "num_iterations": "num_iterations", "importance_sampling_level": "importance_sampling_level",
    "multi_objective_aggregation": "multi_objective_aggregation",
}
_FLAG_OF = {field: flag for flag, field in _TRAIN_OVERRIDES.items()}


def _train_config(args: argparse.Namespace):
    """The run's TrainConfig from --config and the flags, a bad value named by its flag."""
    from jaxtune.errors import ConfigError
    from jaxtune.training.config import TrainConfig

    overrides = {field: getattr(args, flag) for flag, field in _TRAIN_OVERRIDES.items() if getattr(args, flag) is not None}
    if args.no_packing:
        overrides["packing"] = False
    if args.no_compile_cache:
        overrides["compile_cache"] = False
    if args.unroll_layers:
        overrides["unroll_layers"] = True
    if args.offload_optimizer:
        overrides["offload_optimizer"] = True
    if args.offload_embedding:
        overrides["offload_embedding"] = True
    if args.precompute_reference:
        overrides["precompute_reference"] = True
    if args.drop_long_prompts:
        overrides["drop_long_prompts"] = True
    if args.no_share_prompt:
        overrides["share_prompt"] = False
    if args.mask_truncated_completions:
        overrides["mask_truncated_completions"] = True
    try:
        return (TrainConfig.from_yaml(args.config, **overrides) if args.config
                else TrainConfig.from_dict(overrides, where="command line"))
    except ConfigError as e:
        flag = _FLAG_OF.get(e.field)
        if flag is None or flag == e.field or e.field not in overrides:  # the message already names it
            raise
        raise ConfigError(f"--{flag.replace('_', '-')}: {e}", field=e.field) from None


def _train_checks(args: argparse.Namespace):
    """(the run's TrainConfig, its data rows), after every check that needs no model: values, model reference, data
    rows, run directory, reporters."""
    cfg = _train_config(args)
    from jaxtune.io.bundled import check_model_reference
    from jaxtune.data import check_rows, read_rows
    from jaxtune.data.preference import check_preference_rows
    from jaxtune.training.checkpoint import check_run_dir
    from jaxtune.training.reporting import check_reporters

    check_model_reference(args.model)
    rows = read_rows(args.data)
    rewards = _reward_checks(args, cfg, rows)
    if cfg.objective == "sft":
        check_rows(rows, cfg.format)
    elif cfg.objective != "grpo":
        check_preference_rows(rows)
    check_run_dir(args.out, args.resume, cfg)
    check_reporters(cfg.report_to, args.out)
    return cfg, rows, rewards


def _reward_checks(args: argparse.Namespace, cfg, rows) -> dict:
    """GRPO: the reward functions found and imported, one weight each, every row's prompt well formed and short
    enough for --seq-len (with the checkpoint's tokenizer, read without the weights)."""
    from jaxtune.errors import ConfigError

    if cfg.objective != "grpo":
        if args.reward or args.reward_weights:
            raise ConfigError(f"--reward applies to --objective grpo; objective is {cfg.objective!r}")
        return {}
    from jaxtune.rl.rewards import check_weights, resolve_rewards
    from jaxtune.rl.rollout import check_prompt_rows, encode_prompts

    funcs = resolve_rewards(args.reward or [])
    weights = None
    if args.reward_weights:
        try:
            weights = [float(w) for w in args.reward_weights.split(",")]
        except ValueError:
            raise ConfigError(f"--reward-weights {args.reward_weights!r}: give comma-separated numbers, one per "
                              "--reward") from None
    check_weights(weights, funcs)
    check_prompt_rows(rows)
    tokenizer = _tokenizer_only(args.model)
    if tokenizer is not None:
        encode_prompts(rows, tokenizer, cfg.seq_len - cfg.max_completion_length)
    return {"reward_funcs": funcs, "reward_weights": weights}


def _tokenizer_only(model: str):
    """The checkpoint's tokenizer without its weights, or None where that is not cheap (the run checks later)."""
    import warnings

    try:
        from convert.load import load_tokenizer, open_checkpoint
        from jaxtune.io.bundled import resolve_model_path

        _, source, gguf = open_checkpoint(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return source.tokenizer() if gguf is not None else load_tokenizer(resolve_model_path(model))
    except Exception:  # noqa: BLE001 (the model's own checks, with their messages, come when it loads)
        return None


def _train(args: argparse.Namespace) -> None:
    from jaxtune.parallel.distributed import agree_on_checks, initialize_from_env

    try:  # bad values and unusable paths refused before the model loads
        (cfg, rows, rewards), failure = _train_checks(args), None
    except Exception as e:  # noqa: BLE001 (every process of a multi-host run must hear of it, then all stop)
        cfg, rows, rewards, failure = None, None, None, e
    initialize_from_env()  # multi-host launches: before anything else touches JAX
    agree_on_checks(failure)  # a check failed on one host: every process ends, non-zero, with its line
    import jaxtune

    if cfg.mesh:  # a mesh that does not fit the devices fails before the model loads
        from jaxtune.parallel.sharding import make_mesh

        make_mesh(cfg.mesh)
    model, tokenizer = jaxtune.from_pretrained(args.model, dtype=args.dtype, load_in_4bit=True)
    if tokenizer is None:
        raise jaxtune.CheckpointError(f"{args.model} has no tokenizer files; add tokenizer.json to the model directory")
    result = jaxtune.train(model, tokenizer, rows, cfg, out_dir=args.out, resume=args.resume,
                           base_model=model.name_or_path, **rewards)
    state = "interrupted at" if result.interrupted else "finished"
    print(f"{state} step {result.steps}: loss {result.losses[-1]:.4f}, packing efficiency "
          f"{result.packing_efficiency:.1%}, {result.tokens_per_second:,.0f} tokens/s; run in {args.out}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxtune")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "0.1.0"


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as `jaxtune: warning: ...`, without the source file and line Python adds by default."""
    return f"jaxtune: warning: {message}\n"


def build_parser() -> argparse.ArgumentParser:
    from jaxtune.training.config import AGGREGATIONS, GRPO_LOSSES

    parser = _Parser(prog="jaxtune", description="QLoRA fine-tuning of Llama-family models in JAX")
    parser.add_argument("--version", action="version", version=f"jaxtune {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text from a model (HF directory, .gguf file, or 'smollm2')")
    gen.add_argument("model", help="HF model directory, .gguf file, hub id (owner/repo, owner/repo/FILE.gguf, @revision), or smollm2")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    gen.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    gen.add_argument("--adapter", help="a PEFT LoRA adapter directory to apply (e.g. from jaxtune export --peft)")
    gen.add_argument("--load-in-4bit", action="store_true", help="quantize the model to NF4 while loading")
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="write a jaxtune checkpoint (pre-quantized NF4 by default) that loads fast")
    conv.add_argument("src", help="HF model directory (bf16/fp16/fp32 or bnb-4bit), .gguf file, hub id, or smollm2")
    conv.add_argument("dst", help="output directory (must not exist; written atomically)")
    conv.add_argument("--quantize", default="nf4", help="nf4 (default) or none")
    conv.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                      help="dtype of embeddings, norms and lm_head (and of all weights with --quantize none)")
    conv.set_defaults(func=_convert)

    tr = sub.add_parser("train", help="QLoRA fine-tune a model on a local dataset")
    tr.add_argument("--model", required=True, help="HF directory, jaxtune checkpoint, .gguf file, hub id (owner/repo), or smollm2")
    tr.add_argument("--data", required=True, help=".jsonl, .json, .csv, .parquet, or a saved datasets directory")
    tr.add_argument("--out", required=True, help="run directory: checkpoints, metrics.jsonl, loss.png")
    tr.add_argument("--format", choices=["chat", "alpaca", "completion", "text"],
                    help="row format of SFT data (default chat)")
    tr.add_argument("--objective", choices=["sft", "dpo", "orpo", "grpo"],
                    help="sft (default), or preference tuning on prompt/chosen/rejected rows: dpo or orpo")
    tr.add_argument("--beta", type=float, help="DPO: how far the policy may move from the reference (default 0.1); "
                    "GRPO: the KL term's weight (default 0)")
    tr.add_argument("--dpo-loss", choices=["sigmoid", "ipo", "robust"], help="DPO loss variant (default sigmoid)")
    tr.add_argument("--label-smoothing", type=float,
                    help="DPO sigmoid/robust: assumed probability that a pair's preference is flipped (default 0)")
    tr.add_argument("--orpo-lambda", type=float, help="ORPO: weight of the odds-ratio term (default 0.1)")
    tr.add_argument("--precompute-reference", action="store_true",
                    help="DPO: reference log-probabilities once before training instead of a forward per step")
    tr.add_argument("--drop-long-prompts", action="store_true",
                    help="DPO/ORPO: drop pairs whose prompt leaves no room in --seq-len (default: an error)")
    tr.add_argument("--no-share-prompt", action="store_true",
                    help="DPO/ORPO: run each pair's prompt twice, once per response (default: once, both attend to it)")
    grpo = tr.add_argument_group("GRPO (--objective grpo; data rows: prompt + the columns rewards read)")
    grpo.add_argument("--reward", action="append", metavar="FILE.py:FUNC",
                      help="a reward function (TRL's signature), or built-in: last_number (the completion's last "
                           "number equals the row's answer), regex:PATTERN; repeat for several")
    grpo.add_argument("--reward-weights", help="comma-separated weights, one per --reward (default 1 each)")
    grpo.add_argument("--num-generations", type=int, help="completions per prompt (default 8)")
    grpo.add_argument("--max-completion-length", type=int, help="tokens per completion at most (default 512)")
    grpo.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    grpo.add_argument("--top-p", type=float)
    grpo.add_argument("--top-k", type=int)
    grpo.add_argument("--epsilon", type=float, help="ratio clip range (default 0.2)")
    grpo.add_argument("--epsilon-high", type=float, help="upper clip (DAPO: 0.28; default --epsilon)")
    grpo.add_argument("--delta", type=float, help="two-sided GRPO: the ratio's cap (> 1)")
    grpo.add_argument("--loss-type", choices=list(GRPO_LOSSES), help="(default dapo)")
    grpo.add_argument("--scale-rewards", choices=["group", "batch", "none"], help="(default group)")
    grpo.add_argument("--multi-objective-aggregation", choices=list(AGGREGATIONS),
                      help="several rewards: normalize their weighted sum (default), or each one first (GDPO)")
    grpo.add_argument("--num-iterations", type=int, help="optimizer steps per batch of completions (default 1)")
    grpo.add_argument("--importance-sampling-level", choices=["token", "sequence"], help="sequence: GSPO")
    grpo.add_argument("--mask-truncated-completions", action="store_true",
                      help="completions cut at --max-completion-length carry no loss")
    tr.add_argument("--config", help="YAML file of TrainConfig options (command-line flags override it)")
    tr.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    tr.add_argument("--max-steps", type=int)
    tr.add_argument("--seq-len", type=int)
    tr.add_argument("--batch-size", help="micro-batch size, or 'auto'")
    tr.add_argument("--grad-accum", type=int)
    tr.add_argument("--lr", type=float)
    tr.add_argument("--schedule", choices=["constant", "linear", "cosine"])
    tr.add_argument("--warmup-steps", type=int)
    tr.add_argument("--lora-r", type=int)
    tr.add_argument("--lora-alpha", type=float)
    tr.add_argument("--lora-dropout", type=float)
    tr.add_argument("--remat", choices=["auto", "none", "selective", "recompute-experts", "per-layer", "offload"],
                    help="what the backward pass recomputes (default: auto, the fastest policy that fits the device)")
    tr.add_argument("--eval-fraction", type=float)
    tr.add_argument("--eval-steps", type=int)
    tr.add_argument("--save-steps", type=int)
    tr.add_argument("--seed", type=int)
    tr.add_argument("--compute", choices=["bf16", "fp8"],
                    help="fp8: the frozen projections as FP8 GEMMs on Ada/Hopper, but q/k's forward "
                         "(opt-in; default bf16)")
    tr.add_argument("--qat", choices=["none", "q4_0", "q4_k", "nf4"],
                    help="quantization-aware training for the 4-bit export you will make (export --gguf-type q4_0 "
                         "or q4_k_m, or --dtype nf4): the forward sees each merged weight as that format stores it")
    tr.add_argument("--qat-start-step", type=int,
                    help="train the steps before this one without --qat (the faster plain step), the rest with it")
    tr.add_argument("--eval-quantized", choices=["none", "q4_0", "q4_k", "nf4"],
                    help="also log the held-out loss of the 4-bit export you will make (eval_loss_q4_0, "
                         "_q4_k or _nf4 beside eval_loss at every evaluation; needs --eval-fraction)")
    tr.add_argument("--unroll-layers", action="store_true",
                    help="trace each decoder layer on its own instead of looping over them: ~2%% faster steps, "
                         "a longer compile (~1 min at 80 layers); not with --remat offload")
    tr.add_argument("--offload-optimizer", action="store_true",
                    help="keep AdamW's state in host memory between steps (GPU: less device memory at the "
                         "step's peak, one host round trip of that state per step)")
    tr.add_argument("--offload-embedding", action="store_true",
                    help="keep the frozen input embedding in host memory during training, copied in for each "
                         "lookup (GPU: 1 GiB less at the step's peak at 8B; untied models)")
    tr.add_argument("--report-to", help="also log metrics to: tensorboard (RUN/tb/), wandb, or both "
                                        "(comma-separated; needs pip install 'jaxtune[tensorboard]' / '[wandb]')")
    tr.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=4 (default: every device on data)")
    tr.add_argument("--no-packing", action="store_true", help="pad each example to --seq-len instead of packing")
    tr.add_argument("--no-compile-cache", action="store_true",
                    help="GPU: compile the step afresh instead of keeping it in $JAXTUNE_CACHE_DIR (~/.cache/jaxtune/xla)")
    tr.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                    help="compute dtype (float32 is faster on most CPUs)")
    tr.set_defaults(func=_train)

    ex = sub.add_parser("export", help="export a training run (or a model itself) as a PEFT adapter, a merged HF "
                                       "checkpoint and/or a GGUF")
    ex.add_argument("run", nargs="?", help="the --out directory of jaxtune train")
    ex.add_argument("--model", help="instead of a run: a model to export as it is, without adapters (HF directory, "
                                    ".gguf, jaxtune checkpoint, bundled name or hub id), e.g. to a 4-bit GGUF")
    ex.add_argument("--peft", help="output directory for the PEFT LoRA adapter")
    ex.add_argument("--merged", help="output directory for the merged HF checkpoint")
    ex.add_argument("--gguf", help="output .gguf file of the merged model, for llama.cpp / Ollama (Llama, Mistral)")
    ex.add_argument("--gguf-type", default="bf16", choices=["bf16", "f16", "q8_0", "q6_k", "q4_k_m", "q4_0", "f32"],
                    help="tensor type of the GGUF's matrices (norms stay f32); q4_k_m and q6_k mix block types per "
                         "tensor as llama-quantize does")
    ex.add_argument("--gguf-imatrix", metavar="PATH",
                    help="quantize --gguf-type q4_0 / q4_k_m / q6_k with an importance matrix, as llama-quantize "
                         "--imatrix does: llama-imatrix's .gguf, or a data file (e.g. the training data) that the "
                         "model itself is run on to compute one")
    ex.add_argument("--gguf-imatrix-format", choices=["chat", "alpaca", "completion", "text"], default=None,
                    help="format of the --gguf-imatrix data file (default: the run's training format; text for "
                         "--model)")
    ex.add_argument("--base", help="HF directory or .gguf of the original weights to merge onto (default: the run's "
                                   "base model, or the checkpoint it was converted from, when those are unquantized)")
    ex.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "nf4"],
                    help="dtype of the merged weights (nf4: the projections re-quantized as a bitsandbytes 4-bit "
                         "checkpoint)")
    ex.set_defaults(func=_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    import warnings

    from jaxtune.errors import JaxtuneError

    args = build_parser().parse_args(argv)
    python_format, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        args.func(args)
    except (JaxtuneError, NotImplementedError) as e:
        if "jax" in sys.modules:
            from jaxtune.parallel.distributed import exit_now, is_multiprocess

            if is_multiprocess():  # peers may be blocked in a collective: do not wait for them at shutdown
                exit_now(e)
        print(f"jaxtune: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("jaxtune: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = python_format
    return 0


if __name__ == "__main__":
    sys.exit(main())
