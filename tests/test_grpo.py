"""GRPO equals TRL's GRPOTrainer: its loss (every loss_type x scale_rewards x beta x importance-sampling level) and
gradients on the same log-probabilities, one step's LoRA gradients on a tiny model, and the advantages' arithmetic;
rollouts, rewards and the run as a user drives it."""

from __future__ import annotations

import itertools
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxtune.data.packing import IGNORE
from jaxtune.rl.advantages import group_advantages
from jaxtune.rl.loss import GRPO

trl = pytest.importorskip("trl")


# the options of TRL's newer loss types, away from their defaults so that each one is exercised
SAPO_VESPO = dict(sapo_temperature_pos=0.9, sapo_temperature_neg=1.3, vespo_k_pos=1.5, vespo_lambda_pos=2.5,
                  vespo_k_neg=2.5, vespo_lambda_neg=1.5)


def _epsilon_high(loss_type: str) -> float:
    """DAPO's clip-higher, or for CISPO its cap on the ratio (some ratios of `_terms` above it, some below)."""
    return 1.1 if loss_type == "cispo" else 0.28


def _trl_self(loss_type, beta, level, max_completion_length, epsilon_high=0.28, delta=None, accum=1):
    """The attributes GRPOTrainer._compute_loss reads, for one process and `accum` micro-batches per step."""
    from trl import GRPOTrainer

    acc = SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t,
                          gather_for_metrics=lambda t: t)
    return SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=True, delta=delta, steps_per_generation=accum, **SAPO_VESPO),
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=epsilon_high, use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accum, max_completion_length=max_completion_length, accelerator=acc,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics={"train": defaultdict(list)},
        get_gamma_weights=GRPOTrainer.get_gamma_weights)


def _terms(seed: int, b: int = 6, t: int = 9):
    """Random log-probabilities (policy, sampling policy, reference), entropies, advantages and a completion mask
    with completions of different lengths (one fully masked), float32."""
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.05, 4.0, (b, t)).astype(np.float32)
    # ratios outside the clip range too, per token and (a shift per completion) per sequence
    old = (logps + rng.normal(0, 0.3, (b, t)) + rng.normal(0, 0.8, (b, 1))).astype(np.float32)
    ref = (logps + rng.normal(0, 0.5, (b, t))).astype(np.float32)
    entropy = rng.uniform(0, 3, (b, t)).astype(np.float32)
    lengths = rng.integers(1, t + 1, b)
    lengths[2] = 0
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    rewards = rng.normal(size=(b, 2)).astype(np.float32)
    return logps, old, ref, entropy, mask, rewards


@pytest.mark.parametrize("loss_type, level", itertools.product(
    ["dapo", "grpo", "dr_grpo", "bnpo", "luspo", "cispo", "sapo", "vespo"], ["token", "sequence"]))
def test_loss_and_its_gradient_equal_trl(loss_type, level):
    """TRL's own _compute_loss on the same log-probabilities: loss, d loss / d log-probabilities and the logged
    KL, entropy and clip ratios, to 1e-5 in float32, for every scale_rewards and beta; with the sampling policy's
    log-probabilities (num_iterations > 1) and without (the ratio is 1, the gradient the policy gradient)."""
    for scale_rewards, beta, with_old in itertools.product(["group", "batch", "none"], [0.0, 0.04], [True, False]):
        _compare_with_trl(loss_type, level, scale_rewards, beta, with_old)


def _compare_with_trl(loss_type, level, scale_rewards, beta, with_old):
    from trl import GRPOTrainer

    case = f"{loss_type} {level} scale_rewards={scale_rewards} beta={beta} old={with_old}"
    logps, old, ref, entropy, mask, rewards = _terms(seed=5)
    advantages, _ = group_advantages(rewards, np.array([1.0, 0.5], np.float32), 3, scale_rewards)
    b, t = logps.shape
    fake = _trl_self(loss_type, beta, level, t, epsilon_high=_epsilon_high(loss_type))
    logps_t = torch.tensor(logps, requires_grad=True)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (logps_t, torch.tensor(entropy), None)
    inputs = {"prompt_ids": torch.zeros((b, 1), dtype=torch.long), "prompt_mask": torch.ones((b, 1)),
              "completion_ids": torch.zeros((b, t), dtype=torch.long), "completion_mask": torch.tensor(mask),
              "advantages": torch.tensor(advantages), "num_items_in_batch": torch.tensor(mask.sum())}
    if with_old:
        inputs["old_per_token_logps"] = torch.tensor(old)
    if beta:
        inputs["ref_per_token_logps"] = torch.tensor(ref)
    want = GRPOTrainer._compute_loss(fake, None, inputs)
    want.backward()
    logged = {k: v[-1] for k, v in fake._metrics["train"].items()}

    objective = GRPO(loss_type=loss_type, epsilon_low=0.2, epsilon_high=_epsilon_high(loss_type), beta=beta,
                     importance_sampling_level=level, max_completion_length=t, **SAPO_VESPO)
    labels = np.where(mask > 0, 1, IGNORE)[None]
    weights = objective.weights({"labels": jnp.asarray(labels)})

    def loss(lp):
        o = jnp.asarray(old) if with_old else jax.lax.stop_gradient(lp)
        return objective.loss_from_logps(lp, jnp.asarray(entropy), o, jnp.asarray(ref) if beta else None,
                                         jnp.asarray(advantages), jnp.asarray(mask), weights)

    (ours, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(logps))
    np.testing.assert_allclose(float(ours), want.item(), rtol=1e-5, atol=1e-6, err_msg=case)
    np.testing.assert_allclose(np.asarray(grad), logps_t.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=case)
    assert np.abs(logps_t.grad.numpy()).max() > 1e-3, case  # the loss depends on the log-probabilities
    assert set(objective.metric_names) == set(logged), case  # every metric TRL logs, and no other
    for name in objective.metric_names:
        np.testing.assert_allclose(float(metrics[name]), logged[name], rtol=1e-5, atol=1e-6, err_msg=f"{case} {name}")
    if with_old and loss_type in ("dapo", "grpo", "dr_grpo", "bnpo", "luspo"):  # the clipping was compared too
        assert logged["clip_ratio/region_mean"] > 0, case
    if with_old and loss_type == "cispo":
        assert 0 < logged["cispo_clip_ratio"] < 1, case


def _advantages_float64(rewards: np.ndarray, weights: np.ndarray, g: int, scale: str) -> np.ndarray:
    """TRL's rule in float64: weighted NaN-skipping sum, minus the group mean, over the group's (or the batch's)
    sample std + 1e-4; completions with no score are left out of the baseline and get 0."""
    unscorable = np.isnan(rewards).all(1)
    total = np.where(np.isnan(rewards), 0.0, rewards * weights).sum(1)
    total[unscorable] = np.nan
    out = np.zeros(len(total))
    for start in range(0, len(total), g):
        group = total[start:start + g]
        valid = group[~np.isnan(group)]
        batch_valid = total[~np.isnan(total)]
        std = np.std(batch_valid if scale == "batch" else valid, ddof=1)
        adv = group - valid.mean()
        out[start:start + g] = adv if scale == "none" else adv / (std + 1e-4)
    return np.nan_to_num(out)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_normalize_each_group_and_skip_unscored_completions(scale):
    rng = np.random.default_rng(1)
    rewards = rng.normal(size=(12, 3))
    rewards[1, :] = np.nan  # every function skipped it: no baseline share, advantage 0
    rewards[5, 0] = np.nan  # one function skipped it
    rewards[8:12] = [1.0, 0.5, 0.0]  # a group whose completions all scored alike
    weights = np.array([1.0, 0.5, 2.0])
    got, metrics = group_advantages(rewards.astype(np.float32), weights.astype(np.float32), 4, scale)
    np.testing.assert_allclose(got, _advantages_float64(rewards, weights, 4, scale), rtol=1e-4, atol=1e-5)
    assert got[1] == 0 and np.all(got[8:12] == 0)
    assert metrics["frac_reward_zero_std"] == (4 / 12 if scale != "batch" else 0.0)


def test_one_step_on_a_tiny_model_gives_trls_loss_and_lora_gradients(tiny_tokenizer, tmp_path):
    """TRL's GRPOTrainer (its own log-probabilities at the sampling temperature, the reference with the adapters
    disabled) and jaxtune's step on the same rollout: prompt + completion ids, advantages, the sampling policy's
    log-probabilities; loss and every LoRA gradient equal."""
    from datasets import Dataset
    from transformers import LlamaConfig
    from trl import GRPOConfig, GRPOTrainer

    from conftest import copy_lora, set_random_lora
    from jaxtune.rl.rollout import rollout_rows
    from jaxtune.training.step import loss_and_grads, split_model
    from test_preference import COMMON, _grads_close, _models

    model, peft_model = _models(tiny_tokenizer, LlamaConfig, tmp_path / "hf")
    set_random_lora(model, seed=7)
    copy_lora(model, peft_model, __import__("jaxtune.qlora", fromlist=["LORA_TARGETS"]).LORA_TARGETS)
    beta, temperature, g = 0.04, 0.7, 2
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=g,
                      max_completion_length=6, beta=beta, temperature=temperature, loss_type="dapo", use_cpu=True,
                      bf16=False, report_to=[], epsilon_high=0.28)
    trainer = GRPOTrainer(model=peft_model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=args, train_dataset=Dataset.from_list([{"prompt": "hello world"}] * 4),
                          processing_class=tiny_tokenizer)
    eos = tiny_tokenizer.eos_token_id
    prompt = tiny_tokenizer("The quick fox")["input_ids"]  # equal prompts: no left padding (HF positions)
    completions = [[5, 17, eos], [40, 41, 42, 43, 44, 45], [9, eos], [60, 61, 62, 63]]
    prompts = [prompt] * 4
    advantages = np.array([0.9, -0.9, 0.4, -0.4], np.float32)
    t = max(map(len, completions))
    completion_ids = torch.tensor([c + [0] * (t - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (t - len(c)) for c in completions])
    prompt_ids = torch.tensor(prompts)
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([torch.ones_like(prompt_ids), completion_mask], 1)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before each step
    with torch.no_grad():
        with trainer.model.disable_adapter():
            ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, t)
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention, t)
    old = current + torch.tensor(np.random.default_rng(0).normal(0, 0.3, current.shape), dtype=current.dtype)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor(advantages),
              "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": completion_mask.sum().float()}
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()

    seq_len = len(prompt) + t
    rows, _ = rollout_rows(prompts, completions, seq_len, [eos], mask_truncated=False)
    old_rows = np.zeros((4, seq_len), np.float32)
    old_rows[:, len(prompt) - 1:seq_len - 1] = old.numpy()
    batch = {**rows, "advantages": advantages[:, None], "old_logps": old_rows}
    objective = GRPO(loss_type="dapo", epsilon_low=0.2, epsilon_high=0.28, beta=beta, max_completion_length=6,
                     temperature=temperature)
    graphdef, lora, frozen = split_model(model)
    ours, grads, metrics = jax.jit(lambda b: loss_and_grads(graphdef, lora, frozen, b, None, 16, objective))(
        {k: jnp.asarray(v)[None] for k, v in batch.items()})
    np.testing.assert_allclose(float(ours), loss.item(), rtol=1e-5, atol=1e-6)
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    for name in ("kl", "entropy", "clip_ratio/region_mean"):
        np.testing.assert_allclose(float(metrics[name]), logged[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert logged["kl"] > 1e-4  # the adapters moved the policy from the reference: the KL term was compared
    _grads_close(grads, trainer.model, rtol=3e-4)
    assert COMMON["num_hidden_layers"] == 2


# ---- rollouts, rewards and runs as a user drives them ----

ADDITIONS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]


def _tiny_model(tokenizer):
    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model
    from jaxtune.qlora import quantize_layers

    cfg = ModelConfig(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, eos_token_id=tokenizer.eos_token_id)
    return quantize_layers(init_model(cfg, dtype="float32", seed=0))


def _grpo_config(**overrides):
    import jaxtune

    values = dict(objective="grpo", seq_len=40, max_completion_length=12, num_generations=4, micro_batch_size=8,
                  max_steps=2, learning_rate=1e-2, warmup_steps=0, schedule="constant", lora_r=4)
    return jaxtune.TrainConfig(**{**values, **overrides})


def _length_reward(prompts, completions, **_):
    return [float(len(c) % 3) for c in completions]


def test_sampling_uses_the_current_adapters_stops_at_eos_and_is_seeded(tiny_tokenizer):
    """top_k=1 sampling from (graphdef, adapters, frozen) equals greedy generation of the model holding those
    adapters; a row ends with its EOS and -1 after it; the same key gives the same completions, another key other
    ones; ignore_eos never samples EOS."""
    from flax import nnx

    from conftest import set_random_lora
    from jaxtune.generate import generate_tokens
    from jaxtune.qlora import get_peft_model
    from jaxtune.rl.rollout import completion_lists, sample_completions

    model = set_random_lora(get_peft_model(_tiny_model(tiny_tokenizer), r=4, seed=1), seed=3)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    prompts = [tiny_tokenizer(r["prompt"])["input_ids"] for r in ADDITIONS] + [[5, 6]]
    eos = (tiny_tokenizer.eos_token_id,)
    sample = lambda key, **kw: sample_completions(  # noqa: E731
        graphdef, lora, frozen, prompts, jax.random.key(key), max_new_tokens=10, eos_ids=eos, pad_id=0,
        **{"temperature": 1.0, "top_p": 1.0, "top_k": 0, **kw})
    greedy = generate_tokens(model, prompts, max_new_tokens=10, eos_ids=eos)
    top1 = completion_lists(sample(0, top_k=1))
    assert [c[:-1] if c and c[-1] in eos else c for c in top1] == greedy
    assert completion_lists(sample(0, top_k=1, rows_per_call=2)) == top1  # in calls of 2, 2 and 1 rows
    assert completion_lists(sample(0, top_k=1, rows_per_call=2, continuous=True)) == top1  # two slots, refilled
    a, b, c = sample(0), sample(0), sample(1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    for row in completion_lists(a):
        assert all(t >= 0 for t in row) and all(t not in eos for t in row[:-1])
    forced = sample(0, ignore_eos=True, temperature=3.0)
    assert (forced >= 0).all() and not np.isin(forced, eos).any()


def test_every_rollout_of_a_run_is_one_compiled_sampler(tiny_tokenizer):
    """Rollouts whose prompts fall in different length buckets, padded for the run's longest prompt: one compiled
    sampler serves them all (and the completions are the ones each gets padded for its own batch alone)."""
    from flax import nnx

    from jaxtune.qlora import get_peft_model
    from jaxtune.rl.rollout import completion_lists, sample, sample_rollout

    graphdef, lora, frozen = nnx.split(get_peft_model(_tiny_model(tiny_tokenizer), r=4, seed=1), nnx.LoRAParam, ...)
    options = dict(max_new_tokens=4, temperature=0.0, top_p=1.0, top_k=0, eos_ids=(), pad_id=0)
    batches = [[[5, 6], [7]], [list(range(5, 40)), [9, 10, 11]]]  # prompt buckets of 16 and 48 tokens
    before = sample._cache_size()
    padded = [completion_lists(sample_rollout(graphdef, lora, frozen, b, jax.random.key(0), longest_prompt=40,
                                              **options)[0]) for b in batches]
    assert sample._cache_size() == before + 1
    alone = [completion_lists(sample_rollout(graphdef, lora, frozen, b, jax.random.key(0), **options)[0])
             for b in batches]
    assert padded == alone


def test_rows_per_call_is_the_largest_even_split_that_fits():
    from jaxtune.rl.rollout import rows_per_call

    assert rows_per_call(12, lambda rows: rows <= 12) == 12
    assert rows_per_call(12, lambda rows: rows <= 5) == 4
    assert rows_per_call(12, lambda rows: False) is None


def test_the_rollout_is_split_to_fit_the_device_or_refused_in_one_line(tiny_tokenizer, tmp_path, monkeypatch,
                                                                         capsys):
    """A device whose free memory holds the sampler's KV cache and prefill for half a step's completions (XLA's
    plan of the compiled sampler) samples them in two calls; one that cannot hold one completion's stops with one
    line naming what to lower."""
    from flax import nnx

    import jaxtune
    import jaxtune.rl.source as source
    from jaxtune.qlora import get_peft_model
    from jaxtune.rl.rollout import sampling_bytes
    from jaxtune.training.autobatch import MARGIN, StepTooLarge

    cfg = _grpo_config(max_steps=1)
    model = get_peft_model(_tiny_model(tiny_tokenizer), r=cfg.lora_r)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    longest = max(len(tiny_tokenizer(r["prompt"])["input_ids"]) for r in ADDITIONS)
    need = {rows: sampling_bytes(graphdef, lora, frozen, rows, longest, max_new_tokens=cfg.max_completion_length,
                                 temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                 eos_ids=(tiny_tokenizer.eos_token_id,))
            for rows in (1, 4, 8)}
    assert need[1] < need[4] < need[8]

    records = []

    def run(limit):
        monkeypatch.setattr(source, "memory_stats", lambda: {"bytes_limit": limit, "bytes_in_use": 0})
        return jaxtune.train(_tiny_model(tiny_tokenizer), tiny_tokenizer, ADDITIONS, cfg, out_dir=tmp_path / str(limit),
                             reward_funcs=["last_number"], progress=False, callback=records.append)

    assert run(int((need[4] + need[8]) / 2 / MARGIN)).steps == 1
    assert "sampling: 4 slots of continuous batching, each refilled" in capsys.readouterr().out
    # the eight completions through four slots: the first four prefilled at once, the rest as slots free up
    assert records[0]["rollout/slots"] == 4 and records[0]["rollout/prefills"] >= 2
    assert 0 < records[0]["rollout/decode_steps"] <= 2 * cfg.max_completion_length
    assert records[0]["rollout/tokens_per_second"] > 0
    with pytest.raises(StepTooLarge, match="sampling one completion of up to 12 tokens .* lower "
                                           "--max-completion-length"):
        run(int(need[1] / 2 / MARGIN))


def test_the_rollout_reads_the_base_dequantized_once_where_it_fits(tiny_tokenizer, tmp_path, monkeypatch):
    """With per-layer caches the planner samples from the base dequantized once (XLA's plan of that sampler, the
    copies included): every layer's when a step's completions fit that way at once, else the leading layers' that
    fit beside the codes' sampler, else from the codes as before (here each layer's copies made 0.5 GiB larger in
    the plans: a tiny model's copies are smaller than the per-token dequantization's temporaries)."""
    import importlib

    from flax import nnx

    import jaxtune
    import jaxtune.rl.source as source
    from jaxtune.qlora import get_peft_model
    from jaxtune.rl.rollout import sampling_bytes
    from jaxtune.training.autobatch import MARGIN

    monkeypatch.setattr(importlib.import_module("jaxtune.generate"), "PER_LAYER_CACHE", True)
    monkeypatch.setattr(importlib.import_module("jaxtune.rl.rollout"), "DENSE_ROLLOUT", None)  # where it fits
    cfg = _grpo_config(max_steps=1)
    model = get_peft_model(_tiny_model(tiny_tokenizer), r=cfg.lora_r)
    assert model.config.num_layers == 2
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    longest = max(len(tiny_tokenizer(r["prompt"])["input_ids"]) for r in ADDITIONS)

    def copies(dense):
        return 2**29 * (2 if dense < 0 else dense)

    need = {dense: sampling_bytes(graphdef, lora, frozen, 8, longest, max_new_tokens=cfg.max_completion_length,
                                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                  eos_ids=(tiny_tokenizer.eos_token_id,), dense=dense) + copies(dense)
            for dense in (0, 1, -1)}
    monkeypatch.setattr(source, "sampling_bytes", lambda *a, dense=0, **kw: sampling_bytes(*a, dense=dense, **kw)
                        + copies(dense))
    calls = []
    sample = source.sample_rollout
    monkeypatch.setattr(source, "sample_rollout",
                        lambda *a, **kw: calls.append((kw["dense"], kw["rows_per_call"])) or sample(*a, **kw))

    def run(free):
        calls.clear()
        monkeypatch.setattr(source, "memory_stats", lambda: {"bytes_limit": int(free / MARGIN) + 1,
                                                             "bytes_in_use": 0})
        jaxtune.train(_tiny_model(tiny_tokenizer), tiny_tokenizer, ADDITIONS, cfg,
                      out_dir=tmp_path / str(len(list(tmp_path.iterdir()))), reward_funcs=["last_number"],
                      progress=False)
        return calls[0]

    assert run(need[-1]) == (-1, None)  # every layer's copy
    assert run(need[1] + 2**20) == (1, None)  # the first layer's copy, the second layer from the codes
    assert run(need[0] + 2**28) == (0, None)  # the codes only
    monkeypatch.setattr(importlib.import_module("jaxtune.rl.rollout"), "DENSE_ROLLOUT", False)
    assert run(need[-1]) == (0, None)


def test_rollout_rows_put_each_completion_token_where_it_is_predicted():
    from jaxtune.rl.rollout import rollout_rows

    prompts, completions = [[7, 8, 9], [4]], [[10, 11, 2], [12, 13, 14]]
    rows, truncated = rollout_rows(prompts, completions, 8, eos_ids=[2], mask_truncated=False)
    np.testing.assert_array_equal(rows["input_ids"][0], [7, 8, 9, 10, 11, 2, 0, 0])
    np.testing.assert_array_equal(rows["labels"][0], [IGNORE, IGNORE, 10, 11, 2, IGNORE, IGNORE, IGNORE])
    np.testing.assert_array_equal(rows["labels"][1], [12, 13, 14, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE])
    np.testing.assert_array_equal(rows["segment_ids"][1], [1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(rows["positions"][0][:6], np.arange(6))
    assert truncated.tolist() == [False, True]
    masked, _ = rollout_rows(prompts, completions, 8, eos_ids=[2], mask_truncated=True)
    assert (masked["labels"][1] == IGNORE).all() and (masked["labels"][0] == rows["labels"][0]).all()


def test_reward_functions_by_callable_file_and_builtin_name(tmp_path):
    from jaxtune.errors import ConfigError
    from jaxtune.rl.rewards import resolve_rewards, score

    (tmp_path / "r.py").write_text("def shouty(prompts, completions, **kw):\n"
                                   "    return [float(c.isupper()) if c else None for c in completions]\n")
    funcs = resolve_rewards([f"{tmp_path}/r.py:shouty", "last_number", r"regex:.*\d$", _length_reward])
    assert [f.name for f in funcs] == ["shouty", "last_number", "regex", "_length_reward"]
    got = score(funcs, ["q"] * 3, ["HI 4", "it is 5", ""], [[1], [2], []], {"answer": ["4", "4", None]},
                ["r0", "r1", "r2"])
    want = np.array([[1, 1, 1, 1], [0, 0, 1, 1], [np.nan, np.nan, 0, 0]], np.float32)
    np.testing.assert_array_equal(got, want)
    for bad, fix in [(f"{tmp_path}/nope.py:f", "no file"), (f"{tmp_path}/r.py:missing", "no function 'missing'"),
                     ("regex:(", "not a regular expression"), ("shouty", "unknown reward")]:
        with pytest.raises(ConfigError, match=fix):
            resolve_rewards([bad])


@pytest.mark.parametrize("body, message", [
    ("raise KeyError('answer')", r"reward function bad raised KeyError: 'answer' \(batch starting at data\[\d\]\)"),
    ("return [1.0]", r"reward function bad returned 1 rewards for 8 completions"),
    ("return ['x'] * len(completions)", r"reward function bad returned 'x' for completion 0 \(data\[\d\]\)"),
])
def test_a_bad_reward_function_stops_the_run_with_one_line_and_the_last_checkpoint_intact(
        tiny_tokenizer, tmp_path, body, message):
    """It fails at step 2 (step 1 scored fine and was saved): the error names the function and the row, and
    the run directory's checkpoint of step 1 still resumes."""
    import jaxtune
    from jaxtune.rl.rewards import RewardError

    calls = []

    def bad(prompts, completions, **_):
        calls.append(1)
        if len(calls) == 1:
            return [0.0] * len(completions)
        exec(compile(f"def f(completions):\n    {body}", "<reward>", "exec"), scope := {})
        return scope["f"](completions)

    run = tmp_path / "run"
    with pytest.raises(RewardError, match=message):
        jaxtune.train(_tiny_model(tiny_tokenizer), tiny_tokenizer, ADDITIONS, _grpo_config(save_steps=1, max_steps=3),
                      out_dir=run, reward_funcs=[bad], progress=False)
    result = jaxtune.train(_tiny_model(tiny_tokenizer), tiny_tokenizer, ADDITIONS, _grpo_config(max_steps=2),
                           out_dir=run, resume=True, reward_funcs=[_length_reward], progress=False)
    assert result.steps == 2 and len(result.losses) == 2


def test_a_grpo_run_resumes_exactly_and_logs_trls_metrics_and_completions(tiny_tokenizer, tmp_path):
    """4 steps straight, or 2 then a resume to 4: the same losses (rollouts are seeded by step, the prompt order
    is saved; with num_iterations 2 the resume is at a batch's start); metrics.jsonl has TRL's names,
    completions.jsonl the sampled completions of each new batch with their rewards."""
    import json

    import jaxtune

    def run(out, steps, resume=False, **kw):
        return jaxtune.train(_tiny_model(tiny_tokenizer), tiny_tokenizer, ADDITIONS, _grpo_config(max_steps=steps, **kw),
                             out_dir=out, resume=resume, reward_funcs=[_length_reward, "last_number"],
                             reward_weights=[1.0, 0.5], progress=False)

    straight = run(tmp_path / "a", 4, beta=0.04, num_iterations=2)
    run(tmp_path / "b", 2, beta=0.04, num_iterations=2)
    resumed = run(tmp_path / "b", 4, resume=True, beta=0.04, num_iterations=2)
    np.testing.assert_allclose(resumed.losses, straight.losses, rtol=1e-6)
    records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/_length_reward/mean",
                 "rewards/last_number/std", "completions/mean_length", "completions/min_length",
                 "completions/max_length", "completions/clipped_ratio", "kl", "entropy", "clip_ratio/region_mean"):
        assert all(np.isfinite(r[name]) for r in records), name
    assert records[1]["kl"] > 0 and records[0]["kl"] == 0  # the adapters left the reference after step 1
    samples = [json.loads(x) for x in (tmp_path / "a" / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 3} and set(samples[0]["rewards"]) == {"_length_reward",
                                                                                       "last_number"}
    assert samples[0]["prompt"] in [r["prompt"] for r in ADDITIONS] and isinstance(samples[0]["completion"], str)


@pytest.mark.parametrize("options", [dict(), dict(compute="fp8"), dict(qat="q4_0")])
def test_a_reused_batchs_first_step_has_ratio_one_under_the_steps_own_forward(tiny_tokenizer, options):
    """num_iterations 2 keeps the batch's log-probabilities for the ratio; they come from the step's own forward
    (FP8 projections, QAT's rounding, as TRL computes them with the model it trains), so the batch's first step has
    ratio 1 everywhere: the adapters num_iterations 1 trains on the same rollout (a ratio off 1 scales each
    token's gradient)."""
    import jaxtune

    def trained(num_iterations):
        cfg = _grpo_config(max_steps=1, num_iterations=num_iterations, **options)
        model = _tiny_model(tiny_tokenizer)
        jaxtune.train(model, tiny_tokenizer, ADDITIONS, cfg, reward_funcs=[_length_reward], progress=False)
        return [np.asarray(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))]

    one, two = trained(1), trained(2)
    assert max(np.abs(b).max() for b in one[1::2]) > 1e-4  # the step moved the adapters (B starts at zero)
    for a, b in zip(two, one):  # Adam's first update is about lr * sign(gradient): a ratio off 1 flips some (0.02)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_grpo_settings_are_checked_before_any_work():
    import jaxtune
    from jaxtune.errors import ConfigError

    for bad, match in [(dict(micro_batch_size=6), "not a multiple of num_generations 4"),
                       (dict(max_completion_length=40), "leaves no room for a prompt"),
                       (dict(num_generations=1), "num_generations must be an integer >= 2"),
                       (dict(epsilon_high=0.1), "epsilon_high 0.1 is below epsilon"),
                       (dict(loss_type="ppo"), "unknown loss_type"),
                       (dict(eval_fraction=0.1), "eval_fraction does not apply to objective 'grpo'")]:
        with pytest.raises(ConfigError, match=match):
            _grpo_config(**bad)
    assert jaxtune.TrainConfig(objective="grpo").beta == 0.0 and jaxtune.TrainConfig(objective="dpo").beta == 0.1


def test_auto_batch_keeps_whole_groups():
    from jaxtune.errors import JaxtuneError
    from jaxtune.training.loop import _whole_groups

    assert _whole_groups(13, 1, 4) == 12 and _whole_groups(7, 2, 8) == 4 and _whole_groups(8, 1, 8) == 8
    with pytest.raises(JaxtuneError, match="raise grad_accum"):
        _whole_groups(5, 1, 8)


@pytest.mark.parametrize("kernels", [None, "pallas-interpret"])
def test_a_rollout_from_the_base_dequantized_once_samples_the_nf4_rollouts_tokens(tiny_tokenizer, monkeypatch,
                                                                                  kernels):
    """With per-layer caches a rollout may read the base dequantized once (`dense`, where it fits): each layer's own
    array holds the bits the per-token dequantization makes, so greedy and seeded completions are the NF4 path's
    (under the interpreted kernels greedy only: the kernels compute the logits, not the sampling that follows)."""
    import importlib

    from flax import nnx

    import jaxtune
    from conftest import set_random_lora
    from jaxtune.qlora import NF4Linear, get_peft_model
    from jaxtune.rl import rollout

    decoding = importlib.import_module("jaxtune.generate")
    monkeypatch.setattr(decoding, "PER_LAYER_CACHE", True)
    model = set_random_lora(get_peft_model(_tiny_model(tiny_tokenizer), r=4, seed=1), seed=3)
    graphdef, lora, frozen = nnx.split(model, nnx.LoRAParam, ...)
    prompts = [tiny_tokenizer(r["prompt"])["input_ids"] for r in ADDITIONS] + [[5, 6]]
    eos = (tiny_tokenizer.eos_token_id,)
    from jaxtune import ops

    rollout.sample.clear_cache()  # the kernel mode is read when the sampler is traced (an earlier trace: another mode)
    traced = []  # NF4 projections traced through the per-token path
    per_token = ops.nf4_linear
    monkeypatch.setattr(ops, "nf4_linear", lambda *a, **kw: traced.append(1) or per_token(*a, **kw))
    jaxtune.set_kernels(kernels)
    try:
        runs = {}
        for dense in (False, True, 1):  # the codes, every layer's copy, the first layer's copy
            traced.clear()
            runs[dense] = [rollout.sample_completions(graphdef, lora, frozen, prompts, jax.random.key(0),
                                                      max_new_tokens=8, eos_ids=eos, pad_id=0, temperature=t,
                                                      top_p=1.0, top_k=k, dense=dense)
                           for t, k in ((1.0, 1), (1.0, 0))[:1 if kernels else 2]]
            assert bool(traced) != (dense is True)  # the dense rollout's GEMMs read the copies only
        # the copies are the per-token path's weights, bit for bit, one array per layer
        copy = nnx.merge(graphdef, lora, frozen)
        copy.prepare_for_kernels()
        copy.prepare_dense_weights()
        projections = [m for _, m in nnx.iter_modules(copy.layers) if isinstance(m, NF4Linear)]
        assert projections and all(len(m.dense.get_value()) == model.config.num_layers for m in projections)
        from jaxtune.quant import nf4

        for m in projections:
            q = m._arrays()
            for i, w in enumerate(m.dense.get_value()):  # bitsandbytes' arithmetic on layer i's arrays
                layer = nf4.NF4Weight(q.codes[i], q.absmax_codes[i], q.nested_absmax[i], q.offset[i], q.nested_map[i])
                np.testing.assert_array_equal(np.asarray(w), np.asarray(nf4.dequantize(layer, model.dtype)))
    finally:
        jaxtune.set_kernels(None)
        rollout.sample.clear_cache()  # later tests' samplers traced in their own mode
    for partial, got, want in zip(runs[1], runs[True], runs[False]):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(partial, want)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "luspo", "cispo", "sapo", "vespo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_step_of_two_micro_batches_logs_trls_metrics(loss_type, level):
    """Gradient accumulation over two micro-batches of different token counts: the step's loss is the sum of TRL's
    per-micro-batch losses, and each metric TRL's log of them (the micro-batches' own means, averaged unweighted,
    min / max clip ratios included), to 1e-5; the token-weighted mean over the step differs here."""
    from trl import GRPOTrainer

    logps, old, ref, entropy, mask, rewards = _terms(seed=11, b=8, t=9)
    mask[4:] = (np.arange(9)[None] < np.array([[9], [8], [9], [7]])).astype(np.float32)  # more tokens in the 2nd
    advantages, _ = group_advantages(rewards, np.array([1.0, 0.5], np.float32), 4, "group")
    t = logps.shape[1]
    fake = _trl_self(loss_type, 0.04, level, t, epsilon_high=_epsilon_high(loss_type), accum=2)
    want_loss = 0.0
    for half in (slice(0, 4), slice(4, 8)):
        fake._get_per_token_logps_and_entropies = lambda *a, h=half, **k: (torch.tensor(logps[h]),
                                                                           torch.tensor(entropy[h]), None)
        inputs = {"prompt_ids": torch.zeros((4, 1), dtype=torch.long), "prompt_mask": torch.ones((4, 1)),
                  "completion_ids": torch.zeros((4, t), dtype=torch.long), "completion_mask": torch.tensor(mask[half]),
                  "advantages": torch.tensor(advantages[half]), "num_items_in_batch": torch.tensor(mask.sum()),
                  "old_per_token_logps": torch.tensor(old[half]), "ref_per_token_logps": torch.tensor(ref[half])}
        want_loss += GRPOTrainer._compute_loss(fake, None, inputs).item()
    logged = {k: float(np.mean(v)) for k, v in fake._metrics["train"].items()}

    objective = GRPO(loss_type=loss_type, epsilon_low=0.2, epsilon_high=_epsilon_high(loss_type), beta=0.04,
                     importance_sampling_level=level, max_completion_length=t, **SAPO_VESPO)
    labels = np.where(mask > 0, 1, IGNORE).reshape(2, 4, t)
    weights = objective.weights({"labels": jnp.asarray(labels)})
    ours, metrics = 0.0, defaultdict(float)
    for half in (slice(0, 4), slice(4, 8)):
        lp, ent, o, r, adv, m_ = (jnp.asarray(x[half]) for x in (logps, entropy, old, ref, advantages, mask))
        loss, m = objective.loss_from_logps(lp, ent, o, r, adv, m_, weights)
        ours += float(loss)
        for k, v in m.items():
            metrics[k] += float(v)
    case = f"{loss_type} {level}"
    np.testing.assert_allclose(ours, want_loss, rtol=1e-5, atol=1e-6, err_msg=case)
    assert set(metrics) == set(logged), case
    for name, value in logged.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{case} {name}")
    token_weighted = float(np.sum(entropy * mask) / mask.sum())
    assert abs(token_weighted - logged["entropy"]) > 1e-4  # the case tells the two means apart


def _trl_advantages(rewards: np.ndarray, weights: np.ndarray, g: int, scale: str, aggregation: str):
    """GRPOTrainer's advantage and reward-metric arithmetic, in torch with TRL's own nanstd, line for line."""
    from trl.trainer.utils import nanstd

    r, w = torch.tensor(rewards), torch.tensor(weights)
    unscorable = torch.isnan(r).all(dim=1)
    if aggregation == "sum_then_normalize":
        total = (r * w.unsqueeze(0)).nansum(dim=1)
        total[unscorable] = torch.nan
        mean = torch.nanmean(total.view(-1, g), dim=1).repeat_interleave(g)
        std = (nanstd(total).expand_as(total) if scale == "batch"
               else nanstd(total.view(-1, g), dim=1).repeat_interleave(g))
        adv = total - mean
        if scale != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = r.view(-1, g, r.shape[1])
        per_func = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True)
                                                                              + 1e-4)
        total = (per_func.view(-1, r.shape[1]) * w.unsqueeze(0)).nansum(dim=1)
        total[unscorable] = torch.nan
        std = nanstd(total).expand_as(total)
        adv = (total - torch.nanmean(total)) / (std + 1e-4)
    logged = (r * w.unsqueeze(0)).nansum(dim=1)
    logged[unscorable] = torch.nan
    metrics = {"reward": torch.nanmean(logged).item(), "reward_std": nanstd(logged).item(),
               "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item()}
    return torch.nan_to_num(adv, nan=0.0).numpy(), metrics, std.numpy()


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_equal_trls_with_an_unscored_group(scale, aggregation):
    """A group whose every reward is None has no spread (NaN std, not -0.0): it is not counted in
    frac_reward_zero_std, as in TRL; a group that scored alike is; GDPO's normalize_then_sum equals TRL's too."""
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=(12, 2)).astype(np.float32)
    rewards[0:4] = np.nan  # nothing scored the first group
    rewards[5, 1] = np.nan
    rewards[8:12] = [1.0, 0.25]  # every completion of the last group scored alike
    weights = np.array([1.0, 0.5], np.float32)
    got, metrics = group_advantages(rewards, weights, 4, scale, aggregation)
    want, want_metrics, trl_std = _trl_advantages(rewards, weights, 4, scale, aggregation)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-6, err_msg=name)
    if scale == "group" and aggregation == "sum_then_normalize":
        assert np.isnan(trl_std[:4]).all() and metrics["frac_reward_zero_std"] == 4 / 12
    from jaxtune.rl.advantages import _nanstd

    assert np.isnan(_nanstd(np.full(4, np.nan, np.float32))) and np.isnan(_nanstd(np.ones(1, np.float32)))


def test_reward_functions_written_for_trl_get_its_state_loggers_and_may_be_async(tiny_tokenizer, tmp_path):
    """TRL's extras: trainer_state (the step, max_steps), log_extra (a column in completions.jsonl), log_metric
    (metrics.jsonl); an async reward runs on its own loop even when train is called inside a running event loop (a
    notebook); a plain function that takes no extras still gets none. TRL's num_tokens and terminated-length
    metrics are logged too."""
    import asyncio
    import json

    import jaxtune

    seen = []

    def shaped(prompts, completions, trainer_state, log_extra, log_metric, **_):
        seen.append((trainer_state.global_step, trainer_state.max_steps, trainer_state.num_input_tokens_seen))
        log_extra("chars", [len(c) for c in completions])
        log_metric("shaped/mean_chars", float(np.mean([len(c) for c in completions])))
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    async def judged(prompts, completions, **_):
        await asyncio.sleep(0)
        return [float(len(c) % 2) for c in completions]

    def plain(prompts, completions, completion_ids, answer):  # the columns by name, none of TRL's extras
        return [float(a == "3") for a in answer]

    async def run():
        return jaxtune.train(_tiny_model(tiny_tokenizer), tiny_tokenizer, ADDITIONS, _grpo_config(max_steps=2),
                             out_dir=tmp_path / "run", reward_funcs=[shaped, judged, plain], progress=False)

    assert asyncio.run(run()).steps == 2
    assert [s[:2] for s in seen] == [(0, 2), (1, 2)] and 0 < seen[0][2] < seen[1][2]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert [r["num_tokens"] for r in records] == [s[2] for s in seen]
    for r in records:
        assert r["completions/min_terminated_length"] <= r["completions/max_terminated_length"]
        assert np.isfinite(r["shaped/mean_chars"]) and np.isfinite(r["rewards/judged/mean"])
    assert records[1]["rewards/shaped/mean"] == 0.5
    assert all(s["extra"]["chars"] == len(s["completion"]) for s in samples)
