"""TrainConfig: every knob of a run, loadable from YAML and saved beside the run."""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Any

from jaxtune.data.formats import FORMATS
from jaxtune.errors import ConfigError
from jaxtune.ops.context import COMPUTE_MODES
from jaxtune.qlora import ALL_TARGETS

SCHEDULES = ("constant", "linear", "cosine")
REMAT = ("auto", "none", "selective", "recompute-experts", "per-layer", "offload")
REPORTERS = ("tensorboard", "wandb")
OBJECTIVES = ("sft", "dpo", "orpo", "grpo")
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # TRL's multi_objective_aggregation
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
DPO_LOSSES = ("sigmoid", "ipo", "robust")
# 16.7M tokens: 39x the longest step measured on one 80 GB GPU (425,984 tokens); beyond it no single GPU can
# hold even one layer's activations, so the value is a typo, refused before any work
MAX_SEQ_LEN = 2**24

__all__ = ["ConfigError", "TrainConfig"]


@dataclasses.dataclass
class TrainConfig:
    # data
    format: str = "chat"
    seq_len: int = 1024
    packing: bool = True
    train_on_all: bool = False
    eval_fraction: float = 0.0
    seed: int = 0
    # batch
    # or "auto": the largest that fits device memory; default 4 (GRPO: num_generations, one prompt's group)
    micro_batch_size: int | str | None = None
    grad_accum: int = 1
    # optimizer
    learning_rate: float = 2e-4
    # None: "cosine" for SFT; "linear" for DPO, ORPO and GRPO, as TRL's trainers (transformers' default) decay it
    schedule: str | None = None
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    max_grad_norm: float = 1.0
    max_steps: int = 100
    # model
    lora_r: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    use_rslora: bool = False
    # "auto": the fastest policy whose compiled step fits the device (training/remat_choice.py); "selective" is
    # the fastest measured, "recompute-experts" (mixtures of experts), "per-layer" and "offload" trade speed for
    # memory
    remat: str = "auto"
    ce_chunk_size: int = 1024
    # "fp8": the frozen projections (forward and input gradient, but q/k's forward) as FP8 GEMMs; LoRA, norms,
    # attention and the loss keep the model's dtype. Opt-in: see benchmarks/results for speed and accuracy
    compute: str = "bf16"
    # one traced layer per decoder layer instead of a loop over them: ~2% faster steps (no stacks of saved
    # activations to copy), a compile time that grows with the depth (~1 min at 80 layers instead of ~10 s);
    # remat "offload" keeps its own loops
    unroll_layers: bool = False
    # quantization-aware training for a 4-bit export: "q4_0" or "q4_k" (GGUF q4_0 / Q4_K_M) or "nf4" (bitsandbytes)
    # puts each LoRA projection's merged weight through that quantizer in the forward pass, the gradient passing
    # straight through
    qat: str = "none"
    # the steps before this one train without the fake quantization (plain LoRA, the faster step), the rest with it:
    # QAT for the end of a run only
    qat_start_step: int = 0
    # the held-out loss also through a 4-bit format's quantizer ("q4_0", "q4_k" or "nf4": the LoRA projections' merged
    # weights as that export quantizes them), logged as eval_loss_<format> beside eval_loss at every evaluation
    eval_quantized: str = "none"
    # AdamW's state (8 bytes per LoRA parameter: 1.5 GiB at 70B r=16, 0.6 GiB at 8B r=32) lives in host memory
    # between steps, copied in once the backward pass is done and out after the update, so the forward and backward
    # passes, where the peak is, run without it; it costs a host round trip of that state per step
    offload_optimizer: bool = False
    # the frozen input embedding (vocab x hidden: 1 GiB at 8B) lives in host memory during training, copied in for
    # each micro-batch's lookup only, so the backward pass (the peak) runs without it; untied models only
    offload_embedding: bool = False
    # GPU: keep compiled steps in JAX's persistent compilation cache (jaxtune.training.compilation), so a rerun
    # or a resumed run loads its step in seconds instead of compiling it again
    compile_cache: bool = True
    # devices: "data=2,fsdp=4" (see jaxtune.parallel.sharding); None = every device on the data axis
    mesh: str | None = None
    # objective: "sft" (next-token cross-entropy on `format` rows), or preference tuning on prompt/chosen/rejected
    # rows: "dpo" (reference = the model with its adapters off) or "orpo" (no reference)
    objective: str = "sft"
    # DPO: how far the policy may move from the reference (IPO: its tau), 0.1 by default; GRPO: the weight of the
    # KL term to the reference, 0.0 by default (no reference computed), as TRL's configs
    beta: float | None = None
    dpo_loss: str = "sigmoid"  # sigmoid (the DPO paper's), ipo, robust
    label_smoothing: float = 0.0  # DPO sigmoid / robust: the assumed probability that a pair's label is flipped
    orpo_lambda: float = 0.1  # ORPO: weight of the odds-ratio term beside the chosen responses' NLL
    precompute_reference: bool = False  # DPO: reference log-probabilities once before training (no reference forward per step)
    drop_long_prompts: bool = False  # preference rows whose prompt leaves no room in seq_len: dropped (warned), not an error
    share_prompt: bool = True  # DPO/ORPO: each pair's prompt runs once, both responses attend to it (same losses, fewer tokens)
    # GRPO (objective "grpo"), TRL GRPOConfig's names and defaults: each step samples num_generations completions
    # of every prompt (micro_batch_size x grad_accum completions per step, a multiple of num_generations) from the
    # policy being trained, scores them with the reward functions and takes the clipped surrogate step
    num_generations: int = 8
    max_completion_length: int = 512  # seq_len holds the prompt and this many completion tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    epsilon: float = 0.2  # the ratio's clip range [1 - epsilon, 1 + epsilon_high]
    epsilon_high: float | None = None  # None: epsilon (DAPO's clip-higher sets it above)
    delta: float | None = None  # two-sided GRPO: the unclipped ratio also capped at delta (> 1)
    # dapo (tokens of the step), grpo (per sequence), dr_grpo (max_completion_length), bnpo, luspo (summed per
    # sequence); cispo (the detached ratio capped at epsilon_high weights the policy gradient; 5.0 is usual there),
    # sapo (a sigmoid-softened ratio), vespo (a gamma weight of the sequence ratio)
    loss_type: str = "dapo"
    sapo_temperature_pos: float = 1.0  # SAPO: the softening's temperature for positive advantages
    sapo_temperature_neg: float = 1.05  # and for the others
    vespo_k_pos: float = 2.0  # VESPO: the gamma weight's power and decay for non-negative advantages
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # and for negative ones
    vespo_lambda_neg: float = 2.0
    scale_rewards: str = "group"  # advantages divided by the std of the group's rewards, the batch's, or "none"
    # several reward functions: their weighted sum normalized ("sum_then_normalize"), or each normalized within the
    # group before the weighted sum, which is then normalized over the batch ("normalize_then_sum", GDPO)
    multi_objective_aggregation: str = "sum_then_normalize"
    num_iterations: int = 1  # optimizer steps on each batch of completions (> 1: importance ratios matter)
    importance_sampling_level: str = "token"  # "sequence": GSPO's one ratio per completion
    mask_truncated_completions: bool = False  # completions cut at max_completion_length carry no loss
    use_bias_correction_kl: bool = True  # the KL term weighted by the importance ratio (TRL 1.16's default)
    # loop
    logging_steps: int = 1
    eval_steps: int = 0
    save_steps: int = 0
    max_bad_steps: int = 5
    # where the metrics also go, besides metrics.jsonl: "tensorboard" (RUN/tb/) and/or "wandb"
    report_to: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Every field checked (type, range, choices) and the combinations that cannot work refused, each with
        a one-line ConfigError naming the field, the value and the fix; numbers written as YAML strings
        ("2e-4") are read as numbers."""
        if self.micro_batch_size is None:
            self.micro_batch_size = self.num_generations if self.objective == "grpo" else 4
        if self.beta is None:
            self.beta = 0.0 if self.objective == "grpo" else 0.1
        if self.schedule is None:
            self.schedule = "cosine" if self.objective == "sft" else "linear"
        for f in dataclasses.fields(self):
            rule = _RULES.get(f.name)
            if rule is not None and not (f.name in _OPTIONAL and getattr(self, f.name) is None):
                setattr(self, f.name, rule.check(f.name, getattr(self, f.name)))
        self.target_modules = _target_modules(self.target_modules)
        self.report_to = _report_to(self.report_to)
        if self.micro_batch_size != "auto":
            self.micro_batch_size = _MICRO_BATCH.check("micro_batch_size", self.micro_batch_size)
        if self.mesh is not None:
            from jaxtune.parallel.sharding import mesh_axis_sizes

            try:  # the form only here; whether it fits the devices is checked when the run starts
                mesh_axis_sizes(self.mesh)
            except ValueError as e:
                raise ConfigError(str(e), field="mesh") from None
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.qat != "none" and self.compute == "fp8":
            raise ConfigError("qat and compute 'fp8' do not combine: QAT multiplies by the fake-quantized merged "
                              "weight, not the NF4 base; use compute 'bf16'", field="qat")
        if self.qat == "none" and self.qat_start_step:
            raise ConfigError(f"qat_start_step={self.qat_start_step} starts quantization-aware training, which is off: "
                              "set qat (q4_0, q4_k or nf4), or qat_start_step 0", field="qat_start_step")
        if self.qat != "none" and self.qat_start_step >= self.max_steps:
            raise ConfigError(f"qat_start_step={self.qat_start_step} is not before max_steps={self.max_steps}, so no "
                              "step would train through the quantizer: start it earlier", field="qat_start_step")
        if self.qat != "none" and self.lora_dropout > 0:
            raise ConfigError("qat merges LoRA into the weight it quantizes, so LoRA dropout cannot apply; set "
                              "lora_dropout 0", field="qat")
        if self.objective in ("dpo", "orpo") and self.beta == 0:
            raise ConfigError("beta must be > 0 for DPO (0.1 is usual)", field="beta")
        if self.objective == "grpo":
            self._check_grpo()
        if self.objective != "dpo" and self.precompute_reference:
            raise ConfigError(f"precompute_reference needs objective 'dpo' (ORPO and SFT have no reference model); "
                              f"objective is {self.objective!r}", field="precompute_reference")
        if self.dpo_loss == "ipo" and self.label_smoothing:
            raise ConfigError(f"label_smoothing={self.label_smoothing} does not apply to dpo_loss 'ipo'; use 'sigmoid' "
                              "(conservative DPO) or 'robust', or label_smoothing=0", field="label_smoothing")
        if self.warmup_steps >= self.max_steps:  # it runs, but likely not as meant
            warnings.warn(f"warmup_steps ({self.warmup_steps}) is not below max_steps ({self.max_steps}): the learning "
                          "rate never reaches its peak", stacklevel=3)
        if self.eval_quantized != "none" and not self.eval_fraction:
            raise ConfigError(f"eval_quantized={self.eval_quantized!r} needs a held-out split to evaluate on: set "
                              "eval_fraction (e.g. 0.05), or eval_quantized 'none'", field="eval_quantized")
        if self.eval_steps and not self.eval_fraction:
            raise ConfigError(f"eval_steps={self.eval_steps} needs a held-out split to evaluate on: set eval_fraction "
                              "(e.g. 0.05), or eval_steps=0", field="eval_steps")
        if isinstance(self.micro_batch_size, int) and self.micro_batch_size * self.seq_len * self.grad_accum >= 2**31:
            raise ConfigError(f"micro_batch_size x grad_accum x seq_len = "
                              f"{self.micro_batch_size * self.grad_accum * self.seq_len:,} tokens per step is over "
                              "2^31 (token indices are int32); lower seq_len or the batch", field="seq_len")

    def _check_grpo(self) -> None:
        if self.max_completion_length >= self.seq_len:
            raise ConfigError(f"seq_len {self.seq_len} leaves no room for a prompt beside max_completion_length "
                              f"{self.max_completion_length}; raise seq_len to prompt + completion tokens",
                              field="seq_len")
        if isinstance(self.micro_batch_size, int) and (self.micro_batch_size * self.grad_accum) % self.num_generations:
            raise ConfigError(f"micro_batch_size x grad_accum = {self.micro_batch_size * self.grad_accum} completions "
                              f"per step is not a multiple of num_generations {self.num_generations}; each prompt's "
                              "group of completions must be in one step", field="micro_batch_size")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(f"epsilon_high {self.epsilon_high} is below epsilon {self.epsilon}; DAPO's clip-higher "
                              "sets it above (e.g. 0.28)", field="epsilon_high")
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            warnings.warn("loss_type 'luspo' is meant with importance_sampling_level 'sequence' (the paper's setup)",
                          stacklevel=4)
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            warnings.warn("loss_type 'vespo' weighs each sequence's ratio itself: importance_sampling_level should be "
                          "'token' (the default)", stacklevel=4)
        refused = {"eval_fraction": self.eval_fraction > 0, "precompute_reference": self.precompute_reference,
                   "offload_embedding": self.offload_embedding}
        for name, on in refused.items():
            if on:
                raise ConfigError(f"{name} does not apply to objective 'grpo' (its batches are sampled each step); "
                                  f"leave {name} off", field=name)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, **overrides: Any) -> "TrainConfig":
        import yaml

        try:
            with open(path) as f:
                values = yaml.safe_load(f) or {}
        except OSError:
            raise ConfigError(f"config file {path} cannot be read; check the path") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"config file {path} must hold a mapping of option: value")
        return cls.from_dict({**values, **overrides}, where=str(path))

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "config") -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            import difflib

            hints = []
            for name in unknown:
                close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
                hints.append(f"{name} (did you mean {close[0]}?)" if close else str(name))
            raise ConfigError(f"{where}: unknown option(s) {', '.join(hints)}; the options are TrainConfig's fields "
                              "(docs/training.md)")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_modules"], d["report_to"] = list(self.target_modules), list(self.report_to)
        return d


def _number(name: str, value: Any, expected: str, kind: type) -> int | float:
    """value as `kind` (int or float): numbers and numeric strings (YAML, CLI) pass, an int only when integral;
    bools and the rest do not."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if kind is int else float(value)
    if not isinstance(value, bool):
        try:
            number = float(value.strip()) if isinstance(value, str) else float(value)
            if kind is float or number.is_integer():
                return kind(number)
        except (TypeError, ValueError, OverflowError):
            pass
    raise ConfigError(f"{name} must be {expected}, got {value!r}", field=name)


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One field's type and allowed range: `kind` int / float / bool / choice; [low, high] with open ends."""

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()
    fix: str = ""

    def describe(self) -> str:
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return "one of: " + ", ".join(self.choices)
        noun = "an integer" if self.kind == "int" else "a number"
        shown = (lambda x: f"{int(x):,}") if self.kind == "int" else (lambda x: f"{x:g}")  # noqa: E731
        if self.low is not None and self.high is not None:
            return (f"{noun} in {'(' if self.low_open else '['}{shown(self.low)}, "
                    f"{shown(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {shown(self.low)}"
        return noun

    def check(self, name: str, value: Any) -> Any:
        expected = self.describe()
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be {expected}, got {value!r}", field=name)
            return value
        if self.kind == "choice":
            if value not in self.choices:
                raise ConfigError(f"unknown {name} {value!r}; choose {expected}", field=name)
            return value
        number = _number(name, value, expected, int if self.kind == "int" else float)
        ok = math.isfinite(number)
        if ok and self.low is not None:
            ok = number > self.low if self.low_open else number >= self.low
        if ok and self.high is not None:
            ok = number < self.high if self.high_open else number <= self.high
        if not ok:
            fix = f"; {self.fix}" if self.fix else ""
            raise ConfigError(f"{name} must be {expected}, got {value!r}{fix}", field=name)
        return number


_RULES: dict[str, _Rule] = {
    "format": _Rule("choice", choices=FORMATS),
    "seq_len": _Rule("int", 2, MAX_SEQ_LEN, fix="no GPU holds a longer step; shorten it"),
    "packing": _Rule("bool"),
    "train_on_all": _Rule("bool"),
    "eval_fraction": _Rule("float", 0, 1, high_open=True, fix="e.g. 0.05 holds out 5% of the rows"),
    "seed": _Rule("int", 0),
    "grad_accum": _Rule("int", 1),
    "learning_rate": _Rule("float", 0, low_open=True, fix="LoRA learning rates are typically 1e-5 to 1e-3"),
    "schedule": _Rule("choice", choices=SCHEDULES),
    "warmup_steps": _Rule("int", 0),
    "weight_decay": _Rule("float", 0, 1),
    "adam_b1": _Rule("float", 0, 1, high_open=True),
    "adam_b2": _Rule("float", 0, 1, high_open=True),
    "max_grad_norm": _Rule("float", 0, low_open=True, fix="gradients are clipped to this global norm (1.0 is usual)"),
    "max_steps": _Rule("int", 1),
    "lora_r": _Rule("int", 1, 4096, fix="LoRA ranks are typically 8 to 64"),
    "lora_alpha": _Rule("float", 0, low_open=True),
    "lora_dropout": _Rule("float", 0, 1, high_open=True, fix="0.0 to 0.1 is usual"),
    "use_rslora": _Rule("bool"),
    "remat": _Rule("choice", choices=REMAT),
    "ce_chunk_size": _Rule("int", 1),
    "compute": _Rule("choice", choices=COMPUTE_MODES),
    "compile_cache": _Rule("bool"),
    "unroll_layers": _Rule("bool"),
    "qat": _Rule("choice", choices=("none", "q4_0", "q4_k", "nf4"),
                 fix="the format the fine-tune will be exported in"),
    "qat_start_step": _Rule("int", 0),
    "eval_quantized": _Rule("choice", choices=("none", "q4_0", "q4_k", "nf4"),
                            fix="the format the fine-tune will be exported in"),
    "offload_optimizer": _Rule("bool"),
    "offload_embedding": _Rule("bool"),
    "logging_steps": _Rule("int", 1),
    "eval_steps": _Rule("int", 0),
    "save_steps": _Rule("int", 0),
    "max_bad_steps": _Rule("int", 1),
    "objective": _Rule("choice", choices=OBJECTIVES),
    "beta": _Rule("float", 0, fix="0.1 is usual for DPO, 0.0 to 0.04 for GRPO"),
    "dpo_loss": _Rule("choice", choices=DPO_LOSSES),
    "label_smoothing": _Rule("float", 0, 0.5, high_open=True, fix="0.1 is usual for conservative or robust DPO"),
    "orpo_lambda": _Rule("float", 0, fix="0.1 is usual"),
    "precompute_reference": _Rule("bool"),
    "drop_long_prompts": _Rule("bool"),
    "share_prompt": _Rule("bool"),
    "num_generations": _Rule("int", 2, fix="a group needs 2 or more completions to compare (8 is usual)"),
    "max_completion_length": _Rule("int", 1),
    "temperature": _Rule("float", 0, low_open=True, fix="GRPO samples: 1.0 is usual"),
    "top_p": _Rule("float", 0, 1, low_open=True, fix="1.0 samples from the whole distribution"),
    "top_k": _Rule("int", 0, fix="0 turns it off"),
    "epsilon": _Rule("float", 0, 1, high_open=True, fix="0.2 is usual"),
    "epsilon_high": _Rule("float", 0, fix="0.28 is DAPO's"),
    "delta": _Rule("float", 1, low_open=True, fix="e.g. 4"),
    "loss_type": _Rule("choice", choices=GRPO_LOSSES),
    "scale_rewards": _Rule("choice", choices=SCALE_REWARDS),
    "multi_objective_aggregation": _Rule("choice", choices=AGGREGATIONS),
    "sapo_temperature_pos": _Rule("float", 0, low_open=True, fix="1.0 is SAPO's"),
    "sapo_temperature_neg": _Rule("float", 0, low_open=True, fix="1.05 is SAPO's"),
    "vespo_k_pos": _Rule("float", 0, fix="2.0 is VESPO's"),
    "vespo_lambda_pos": _Rule("float", 0, fix="3.0 is VESPO's"),
    "vespo_k_neg": _Rule("float", 0, fix="3.0 is VESPO's"),
    "vespo_lambda_neg": _Rule("float", 0, fix="2.0 is VESPO's"),
    "num_iterations": _Rule("int", 1),
    "importance_sampling_level": _Rule("choice", choices=IMPORTANCE_SAMPLING_LEVELS),
    "mask_truncated_completions": _Rule("bool"),
    "use_bias_correction_kl": _Rule("bool"),
}
_OPTIONAL = {"epsilon_high", "delta"}  # None: off


_MICRO_BATCH = _Rule("int", 1, fix="or 'auto': the largest that fits device memory")


def _names(name: str, value: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A list of names, or one comma-separated string of them (CLI, YAML), each one of `allowed`."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ConfigError(f"{name} must be a list of names from: {', '.join(allowed)}; got {value!r}", field=name)
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise ConfigError(f"unknown {name} {', '.join(map(repr, unknown))}; choose from: {', '.join(allowed)}",
                          field=name)
    return tuple(dict.fromkeys(items))


def _target_modules(value: Any) -> tuple[str, ...]:
    names = _names("target_modules", value, ALL_TARGETS)
    if not names:
        raise ConfigError(f"target_modules is empty: LoRA needs at least one of {', '.join(ALL_TARGETS)}",
                          field="target_modules")
    return names


def _report_to(value: Any) -> tuple[str, ...]:
    if value in (None, "none", ""):
        return ()
    return _names("report_to", value, REPORTERS)
