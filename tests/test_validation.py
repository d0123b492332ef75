"""Bad values are refused before any work, in one line that names the value and the fix: every TrainConfig
field's bounds, every CLI flag with a bad value (no traceback, exit status != 0, nothing written), the dataset and
run directory checked before the model loads, and a step too large for memory refused before it runs."""

from __future__ import annotations

import dataclasses
import json

import pytest

import jaxtune
from jaxtune.cli import build_parser, main
from jaxtune.errors import ConfigError
from jaxtune.training.config import MAX_SEQ_LEN, TrainConfig

# field -> (values refused, values at the edge that are accepted)
BOUNDS = {
    "format": (["sharegpt", 1], ["text"]),
    "seq_len": ([0, 1, -5, MAX_SEQ_LEN + 1, 2.5, "long", True], [2, MAX_SEQ_LEN]),
    "packing": (["yes", 1], [False]),
    "train_on_all": (["no", 0], [True]),
    "eval_fraction": ([-0.1, 1.0, 1.5, float("nan")], [0.0, 0.99]),
    "seed": ([-1, 1.5], [0]),
    "micro_batch_size": ([0, -2, "big", 1.5], [1, "auto", "8", None]),
    "grad_accum": ([0, -1], [1]),
    "learning_rate": ([-1.0, 0.0, float("inf"), float("nan"), "fast"], [1e-9, 1.5, "2e-4"]),
    "schedule": (["exp"], ["constant"]),
    "warmup_steps": ([-1, 0.5], [0, 99]),
    "weight_decay": ([-0.1, 2.0], [0.0, 1.0]),
    "adam_b1": ([-0.1, 1.0], [0.0, 0.99]),
    "adam_b2": ([1.0, 1.1], [0.0, 0.999]),
    "max_grad_norm": ([0.0, -1.0], [1e-3]),
    "max_steps": ([0, -3], [1]),
    "lora_r": ([0, -8, 5000], [1, 4096]),
    "lora_alpha": ([0.0, -16.0], [1e-3]),
    "lora_dropout": ([-0.1, 1.0, 1.5], [0.0, 0.5]),
    "target_modules": ([[], ["q_proj", "attn"], "qkv", [1]], [["q_proj"], "q_proj,v_proj"]),
    "use_rslora": (["true"], [True]),
    "remat": (["full"], ["offload"]),
    "ce_chunk_size": ([0], [1]),
    "compute": (["int8", "fp16"], ["fp8"]),
    "compile_cache": ([1], [False]),
    "unroll_layers": (["yes"], [True]),
    "qat": (["q3_k", None, 4], ["q4_0", "q4_k", "nf4", "none"]),
    "eval_quantized": (["q3_k", None, 4], ["none"]),
    "qat_start_step": ([-1, 1.5], [0]),
    "offload_optimizer": (["on"], [True]),
    "offload_embedding": ([0], [False]),
    "mesh": (["tp=2", "data"], ["data=1"]),
    "logging_steps": ([0], [1]),
    "eval_steps": ([-1], [0]),
    "save_steps": ([-1], [0, 5]),
    "max_bad_steps": ([0], [1]),
    "report_to": ([["tensorboardx"], "tb", [3]], [["tensorboard"], "tensorboard,wandb", "none"]),
    "objective": (["ppo", 1], ["dpo", "orpo"]),
    "beta": ([-0.1, "x"], [0.0, 1e-6, None]),
    "dpo_loss": (["hinge"], ["ipo", "robust"]),
    "label_smoothing": ([-0.1, 0.5], [0.0, 0.49]),
    "orpo_lambda": ([-0.1], [0.0]),
    "precompute_reference": (["yes", 1], [False]),
    "drop_long_prompts": (["yes", 1], [True]),
    "share_prompt": (["no", 0], [False]),
    "num_generations": ([1, 0, 2.5], [2, 16]),
    "max_completion_length": ([0], [1]),
    "temperature": ([0.0, -1.0], [1e-3, 2.0]),
    "top_p": ([0.0, 1.1], [1.0]),
    "top_k": ([-1], [0, 50]),
    "epsilon": ([-0.1, 1.0], [0.0, 0.2]),
    "epsilon_high": ([-0.1, "x"], [None, 0.28]),
    "delta": ([1.0, 0.5], [None, 4.0]),
    "loss_type": (["ppo"], ["dapo", "grpo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo", "vespo"]),
    "sapo_temperature_pos": ([0.0, -1.0], [1e-3, 1.0]),
    "sapo_temperature_neg": ([0.0], [1.05]),
    "vespo_k_pos": ([-0.5], [0.0, 2.0]),
    "vespo_lambda_pos": ([-1.0], [0.0, 3.0]),
    "vespo_k_neg": ([-0.5], [3.0]),
    "vespo_lambda_neg": ([-1.0], [2.0]),
    "scale_rewards": (["mean", True], ["group", "batch", "none"]),
    "multi_objective_aggregation": (["sum"], ["sum_then_normalize", "normalize_then_sum"]),
    "num_iterations": ([0], [1, 4]),
    "importance_sampling_level": (["token-level"], ["token", "sequence"]),
    "mask_truncated_completions": (["yes"], [True]),
    "use_bias_correction_kl": ([1], [False]),
}


def test_every_field_has_bounds_under_test():
    assert set(BOUNDS) == {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("field,value", [(f, v) for f, (bad, _) in BOUNDS.items() for v in bad])
def test_a_field_out_of_bounds_is_refused_in_one_line(field, value):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**{field: value})
    msg = str(e.value)
    assert "\n" not in msg and field.split("_")[0] in msg and e.value.field == field, msg


@pytest.mark.parametrize("field,value", [(f, v) for f, (_, good) in BOUNDS.items() for v in good])
def test_a_field_at_its_edge_is_accepted(field, value):
    TrainConfig(**{field: value})


def test_numbers_written_as_strings_in_yaml_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 2e-4\nseq_len: '512'\nreport_to: tensorboard\n")  # YAML reads 2e-4 as a string
    cfg = TrainConfig.from_yaml(path)
    assert cfg.learning_rate == 2e-4 and cfg.seq_len == 512 and cfg.report_to == ("tensorboard",)


@pytest.mark.parametrize("values,words", [
    (dict(eval_steps=10), "needs a held-out split"),
    (dict(eval_quantized="q4_0"), "needs a held-out split"),
    (dict(qat_start_step=2), "starts quantization-aware training, which is off"),
    (dict(qat="q4_0", qat_start_step=100, max_steps=100), "is not before max_steps=100"),
    (dict(seq_len=2**20, micro_batch_size=2048), "over 2^31"),
])
def test_combinations_that_cannot_work_are_refused(values, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("^", r"\^")):
        TrainConfig(**values)


def test_a_warmup_as_long_as_the_run_is_warned_about():
    with pytest.warns(UserWarning, match=r"warmup_steps \(100\) is not below max_steps \(100\)"):
        TrainConfig(warmup_steps=100, max_steps=100)


def test_get_peft_model_refuses_bad_values_as_jaxtune_errors(tiny_qlora_model):
    for kwargs in (dict(lora_dropout=1.5), dict(r=0), dict(lora_alpha=-1.0), dict(target_modules=["attn"])):
        with pytest.raises(jaxtune.JaxtuneError):
            jaxtune.get_peft_model(tiny_qlora_model, **kwargs)


# ---- the command line -------------------------------------------------------------------------------------


# every flag of every subcommand -> a bad value for it (flags that take no value: a bad combination)
BAD_FLAGS = {
    "train": {
        "--format": "sharegpt", "--max-steps": "0", "--seq-len": "100000000", "--batch-size": "zero",
        "--grad-accum": "-1", "--lr": "-1", "--schedule": "exp", "--warmup-steps": "-1", "--lora-r": "0",
        "--lora-alpha": "-2", "--lora-dropout": "1.5", "--remat": "full", "--eval-fraction": "1.5",
        "--eval-steps": "-3", "--save-steps": "-1", "--seed": "-1", "--compute": "int8", "--qat": "q3_k",
        "--eval-quantized": "q3_k", "--qat-start-step": "-1", "--mesh": "tp=2",
        "--report-to": "tb", "--config": "missing.yaml", "--dtype": "float8", "--data": "missing.jsonl",
        "--model": "missing-model-dir", "--out": "a-file", "--resume": None, "--no-packing": None,
        "--no-compile-cache": None, "--objective": "ppo", "--beta": "-1", "--dpo-loss": "hinge",
        "--label-smoothing": "0.5", "--orpo-lambda": "-1", "--precompute-reference": None,
        "--drop-long-prompts": None, "--no-share-prompt": None, "--unroll-layers": None,
        "--offload-optimizer": None, "--offload-embedding": None, "--reward": "missing.py:f",
        "--reward-weights": "x", "--num-generations": "1", "--max-completion-length": "0", "--temperature": "0",
        "--top-p": "0", "--top-k": "-1", "--epsilon": "1.5", "--epsilon-high": "-1", "--delta": "0.5",
        "--loss-type": "ppo", "--scale-rewards": "mean", "--num-iterations": "0",
        "--importance-sampling-level": "word", "--mask-truncated-completions": None,
        "--multi-objective-aggregation": "sum",
    },
    "generate": {"--max-new-tokens": "0", "--temperature": "-1", "--top-p": "0", "--seed": "x",
                 "--dtype": "int4", "--adapter": "missing-adapter", "--prompt": "", "--raw": None,
                 "--load-in-4bit": None},
    "convert": {"--quantize": "int3", "--dtype": "int4"},
    "export": {"--peft": "exists", "--merged": "exists", "--gguf": "out.txt", "--gguf-type": "q4_k",
               "--base": "missing-base", "--dtype": "int4", "--model": "missing-model",
               "--gguf-imatrix": "missing-imatrix.gguf", "--gguf-imatrix-format": "xml"},
}


def _flags_of(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


@pytest.mark.parametrize("command", sorted(BAD_FLAGS))
def test_every_flag_is_walked(command):
    assert set(BAD_FLAGS[command]) == _flags_of(command)


def _argv(command: str, flag: str, value: str | None, tmp_path, data) -> list[str]:
    """The subcommand with good values everywhere but `flag`; flags without a value go with a bad partner."""
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "exists").mkdir(exist_ok=True)
    out = str(tmp_path / "run")
    if command == "train":
        base = {"--model": "smollm2", "--data": str(data), "--out": out}
        if value is None:  # a switch: pair it with a refused value so the run stops before loading
            return ["train", *sum(([k, v] for k, v in base.items()), []), flag, "--lr", "-1"]
        base[flag] = str(tmp_path / value) if flag in ("--data", "--out", "--config") else value
        return ["train", *sum(([k, v] for k, v in base.items() if k != flag), []), flag, base[flag]]
    if command == "generate":
        argv = ["generate", "smollm2"] + ([] if flag == "--prompt" else ["--prompt", "hi"])
        if value is None:
            return [*argv, flag, "--top-p", "2"]
        if flag == "--adapter":
            value = str(tmp_path / value)
        return [*argv, flag, value] if flag != "--adapter" else [*argv, flag, value, "--max-new-tokens", "0"]
    if command == "convert":
        return ["convert", "smollm2", str(tmp_path / "converted"), flag, value]
    value = str(tmp_path / value) if flag in ("--peft", "--merged", "--gguf", "--base") else value
    argv = ["export", str(tmp_path / "no-run"), flag, value]
    return argv if flag in ("--peft", "--merged", "--gguf") else [*argv, "--peft", str(tmp_path / "exists")]


@pytest.mark.parametrize("command,flag", [(c, f) for c in sorted(BAD_FLAGS) for f in sorted(BAD_FLAGS[c])])
def test_a_bad_flag_value_is_one_error_line_without_a_traceback(command, flag, tmp_path, chat_data, capsys,
                                                               no_model_load, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = _argv(command, flag, BAD_FLAGS[command][flag], tmp_path, chat_data)
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's refusals
        code = e.code
    err = capsys.readouterr().err
    assert code not in (0, None), argv
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("jaxtune: error: ") and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, f"{argv} wrote files"


def test_a_row_without_its_fields_is_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" + json.dumps({"text": "x"}) + "\n")
    code = main(["train", "--model", "smollm2", "--data", str(data), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and f"{data}:2: missing field 'messages'" in err and not (tmp_path / "run").exists()


def test_a_run_directory_with_checkpoints_is_refused_before_the_model_loads(tmp_path, chat_data, capsys,
                                                                           no_model_load):
    (tmp_path / "run" / "checkpoints" / "7").mkdir(parents=True)
    code = main(["train", "--model", "smollm2", "--data", str(chat_data), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and "already holds checkpoints (step 7)" in err and "--resume" in err


# ---- memory ----------------------------------------------------------------------------------------------


def test_a_step_larger_than_memory_is_refused_before_it_runs(tiny_tokenizer, tiny_qlora_model, tmp_path,
                                                             monkeypatch):
    """On CPU the compiled step's size is compared with the host memory available; a step that cannot fit is
    refused in one line naming both and what to change, before any step runs or any file is written."""
    from jaxtune.training import autobatch
    from jaxtune.training.autobatch import StepTooLarge

    monkeypatch.setattr(autobatch, "available_ram_bytes", lambda: 1024)
    rows = [{"text": "the quick brown fox jumps over the lazy dog"}] * 8
    cfg = TrainConfig(format="text", seq_len=32, micro_batch_size=2, max_steps=1)
    with pytest.raises(StepTooLarge) as e:
        jaxtune.train(tiny_qlora_model, tiny_tokenizer, rows, cfg, out_dir=tmp_path / "run", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "host memory has 0.0 GiB" in msg and "--seq-len (now 32)" in msg, msg
    assert "--batch-size (now 2)" in msg and "--remat offload" not in msg  # offloading to the host saves no host memory
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.gpu
def test_a_step_too_large_for_the_gpu_is_refused_in_one_line(tiny_tokenizer, tmp_path):
    """On GPU a first step that runs out of device memory at micro-batch 1 ends in the one-line refusal (what the
    step needs, what the device has, what to change), not a RESOURCE_EXHAUSTED traceback."""
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers
    from jaxtune.training.autobatch import StepTooLarge

    cfg = ModelConfig(model_type="llama", vocab_size=len(tiny_tokenizer), hidden_size=2048, intermediate_size=8192,
                      num_layers=4, num_heads=16, num_kv_heads=8, head_dim=128, eos_token_id=tiny_tokenizer.eos_token_id)
    model = quantize_layers(init_model(cfg, dtype="bfloat16", seed=0))
    rows = [{"text": "the quick brown fox jumps over the lazy dog"}] * 4
    config = TrainConfig(format="text", seq_len=2**22, micro_batch_size=1, max_steps=1, remat="none")
    with pytest.raises(StepTooLarge) as e:
        jaxtune.train(model, tiny_tokenizer, rows, config, out_dir=tmp_path / "run", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "the device has" in msg and "--seq-len (now 4,194,304)" in msg, msg
