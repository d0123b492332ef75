"""DPO and ORPO equal TRL's own trainers (losses, logged rewards, LoRA gradients) on tiny random models, and
preference data is tokenized as TRL tokenizes it."""

from __future__ import annotations

import tempfile

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import LlamaConfig, Qwen2Config

import jaxtune
from conftest import build_hf_model, copy_lora, peft_lora_modules, peft_reference, set_random_lora
from jaxtune.data.preference import encode_pairs, pack_pairs
from jaxtune.data.sources import Row
from jaxtune.qlora import LORA_TARGETS, get_peft_model
from jaxtune.training.objectives import Preference
from jaxtune.training.step import loss_and_grads, split_model

trl = pytest.importorskip("trl")

ROWS = [
    {"prompt": "The quick fox", "chosen": " jumps over the dog", "rejected": " is lazy"},
    {"prompt": "hello world", "chosen": " yes 0123", "rejected": " no"},
    {"prompt": "Paris is", "chosen": " the capital", "rejected": " a dog. The quick brown"},
    {"prompt": "What is 2+2?", "chosen": " 4", "rejected": " 5, said the fox"},
]
CONVERSATIONAL = [
    {"prompt": [{"role": "user", "content": "Capital of France?"}],
     "chosen": [{"role": "assistant", "content": "Paris."}],
     "rejected": [{"role": "assistant", "content": "Lisbon, the quick fox said."}]},
]
IMPLICIT_PROMPT = [  # conversational rows without a prompt: the shared first messages are the prompt
    {"chosen": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}],
     "rejected": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "no"}]},
]
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _models(tokenizer, hf_cls, tmp_path):
    """(jaxtune QLoRA model with random adapters R, PEFT model of the same weights and adapters)."""
    hf_model = build_hf_model(hf_cls(vocab_size=len(tokenizer), **COMMON), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32", load_in_4bit=True)
    get_peft_model(model, r=8, lora_alpha=16, target_modules=LORA_TARGETS, seed=1)
    set_random_lora(model, seed=2)
    return model, peft_reference(hf_model, model, r=8, alpha=16, rslora=False, targets=LORA_TARGETS)


def _batch(pairs, seq_len=96):
    packed = pack_pairs(pairs, seq_len)
    return {k: v[None] for k, v in packed.arrays().items()}  # one micro-batch of every row


def _grads_close(grads, peft_model, rtol=2e-4):
    """jaxtune's LoRA gradients (stacked over layers) against the PEFT adapter's .grad, per projection."""
    flat = {tuple(str(p) for p in path): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
            for path, v in nnx.to_flat_state(grads)}
    checked = 0
    for (name, i), mod in peft_lora_modules(peft_model, LORA_TARGETS).items():
        parent = "self_attn" if name[0] in "qkvo" else "mlp"
        for ours_key, theirs in (("lora_a", mod.lora_A["default"].weight.grad),
                                 ("lora_b", mod.lora_B["default"].weight.grad)):
            ours = flat[("layers", parent, name, ours_key)][i]
            want = theirs.numpy()
            np.testing.assert_allclose(ours, want, rtol=rtol, atol=rtol * np.abs(want).max() + 1e-7,
                                       err_msg=f"{name} {ours_key} layer {i}")
            checked += 1
    assert checked == 2 * len(LORA_TARGETS) * COMMON["num_hidden_layers"]


def test_preference_rows_tokenize_as_trl(tiny_tokenizer):
    from datasets import Dataset
    from trl.trainer.dpo_trainer import DPOTrainer

    for rows in (ROWS, CONVERSATIONAL, IMPLICIT_PROMPT):
        prepared = DPOTrainer._prepare_dataset(_TokenizerOnly(tiny_tokenizer), Dataset.from_list(rows),
                                               tiny_tokenizer, _Args(), "train")
        pairs = encode_pairs([Row(r, f"row {i}") for i, r in enumerate(rows)], tiny_tokenizer)
        for want, got in zip(prepared, pairs):
            assert got.prompt.tolist() == want["prompt_ids"]
            assert got.chosen.tolist() == want["chosen_ids"]
            assert got.rejected.tolist() == want["rejected_ids"]


class _TokenizerOnly:
    """The trainer attributes `_prepare_dataset` reads."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer


class _Args:
    dataset_num_proc = None
    max_length = None
    truncation_mode = "keep_start"


def _dpo_trainer(peft_model, tokenizer, out, **config):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(output_dir=out, bf16=False, report_to=[], per_device_train_batch_size=len(ROWS), use_cpu=True,
                     max_length=None, **config)
    return DPOTrainer(model=peft_model, args=args, train_dataset=Dataset.from_list(ROWS), processing_class=tokenizer)


@pytest.mark.parametrize("hf_cls, loss_type, smoothing", [
    (LlamaConfig, "sigmoid", 0.0),
    (Qwen2Config, "sigmoid", 0.0),
    (LlamaConfig, "ipo", 0.0),
    (Qwen2Config, "robust", 0.1),
])
def test_dpo_loss_rewards_and_grads_equal_trl(tiny_tokenizer, tmp_path, hf_cls, loss_type, smoothing):
    """TRL's DPOTrainer copies the adapters it is given as its reference ("ref"); the policy then gets other
    random adapters, so rewards are non-zero. jaxtune gets the same two adapter sets."""
    model, peft_model = _models(tiny_tokenizer, hf_cls, tmp_path / "hf")
    trainer = _dpo_trainer(peft_model, tiny_tokenizer, str(tmp_path / "trl"), beta=0.3, loss_type=[loss_type],
                           label_smoothing=smoothing)
    graphdef, reference, frozen = split_model(model)
    reference = jax.tree.map(np.asarray, reference)  # adapters R: the reference
    set_random_lora(model, seed=3)  # adapters P: the policy
    copy_lora(model, trainer.model, LORA_TARGETS)

    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    pairs = encode_pairs([Row(r, f"row {i}") for i, r in enumerate(ROWS)], tiny_tokenizer)
    _, lora, _ = split_model(model)
    objective = Preference("dpo", beta=0.3, loss_type=loss_type, label_smoothing=smoothing)
    ours, grads, metrics = jax.jit(lambda b: loss_and_grads(graphdef, lora, (frozen, reference), b, None, 16,
                                                            objective))(_batch(pairs))
    np.testing.assert_allclose(float(ours), loss.item(), rtol=1e-5, atol=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected"):
        np.testing.assert_allclose(float(metrics[name]), logged[name], rtol=1e-5, atol=1e-5, err_msg=name)
    assert abs(logged["rewards/margins"]) > 1e-3  # policy and reference differ: the comparison means something
    _grads_close(grads, trainer.model)


def test_conservative_dpo_equals_its_formula_in_float64(tiny_tokenizer, tmp_path):
    """Label smoothing on the sigmoid loss (cDPO), against -(1-ε) log σ(βΔ) - ε log σ(-βΔ) in float64, with each
    pair's βΔ from TRL (rewards/margins of a one-pair batch)."""
    model, peft_model = _models(tiny_tokenizer, LlamaConfig, tmp_path / "hf")
    trainer = _dpo_trainer(peft_model, tiny_tokenizer, str(tmp_path / "trl"), beta=0.5)
    graphdef, reference, frozen = split_model(model)
    reference = jax.tree.map(np.asarray, reference)
    set_random_lora(model, seed=4)
    copy_lora(model, trainer.model, LORA_TARGETS)
    margins = []
    with torch.no_grad():
        for i in range(len(ROWS)):
            trainer.compute_loss(trainer.model, trainer.data_collator([trainer.train_dataset[i]]))
            margins.append(trainer._metrics["eval"]["rewards/margins"][-1])
    m, eps = np.asarray(margins, np.float64), 0.2
    want = np.mean((1 - eps) * np.logaddexp(0, -m) + eps * np.logaddexp(0, m))
    pairs = encode_pairs([Row(r, f"row {i}") for i, r in enumerate(ROWS)], tiny_tokenizer)
    _, lora, _ = split_model(model)
    ours, _, _ = loss_and_grads(graphdef, lora, (frozen, reference), _batch(pairs), None, 16,
                                Preference("dpo", beta=0.5, label_smoothing=eps))
    np.testing.assert_allclose(float(ours), want, rtol=1e-5)


def _orpo_batch(pairs, pad: int):
    """ORPOTrainer's batch format from token ids: prompt tokens labeled -100."""
    out = {}
    for side in ("chosen", "rejected"):
        seqs = [np.concatenate([p.prompt, getattr(p, side)]) for p in pairs]
        width = max(len(s) for s in seqs)
        ids = np.full((len(seqs), width), pad, np.int64)
        mask = np.zeros((len(seqs), width), np.int64)
        labels = np.full((len(seqs), width), -100, np.int64)
        for i, (s, p) in enumerate(zip(seqs, pairs)):
            ids[i, :len(s)], mask[i, :len(s)] = s, 1
            labels[i, len(p.prompt):len(s)] = s[len(p.prompt):]
        out.update({f"{side}_input_ids": torch.from_numpy(ids), f"{side}_attention_mask": torch.from_numpy(mask),
                    f"{side}_labels": torch.from_numpy(labels)})
    return out


@pytest.mark.parametrize("hf_cls", [LlamaConfig, Qwen2Config])
def test_orpo_loss_rewards_and_grads_equal_trl(tiny_tokenizer, tmp_path, hf_cls):
    """TRL's ORPOTrainer takes its NLL over the chosen prompt and response (jaxtune: train_on_all=True); the
    default NLL (responses only) is checked against torch's cross-entropy of the same logits."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    model, peft_model = _models(tiny_tokenizer, hf_cls, tmp_path / "hf")
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), beta=0.25, bf16=False, report_to=[], use_cpu=True,
                      per_device_train_batch_size=len(ROWS))
    trainer = ORPOTrainer(model=peft_model, args=args, train_dataset=Dataset.from_list(ROWS),
                          processing_class=tiny_tokenizer)
    pairs = encode_pairs([Row(r, f"row {i}") for i, r in enumerate(ROWS)], tiny_tokenizer)
    trainer.model.train()
    loss, logged = trainer.get_batch_loss_metrics(trainer.model, _orpo_batch(pairs, tiny_tokenizer.pad_token_id))
    loss.backward()

    graphdef, lora, frozen = split_model(model)
    batch = _batch(pairs)
    ours, grads, metrics = loss_and_grads(graphdef, lora, frozen, batch, None, 16,
                                          Preference("orpo", orpo_lambda=0.25, nll_on_prompt=True))
    np.testing.assert_allclose(float(ours), loss.item(), rtol=1e-5, atol=1e-6)
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected", "nll_loss", "log_odds_ratio", "log_odds_chosen"):
        np.testing.assert_allclose(float(metrics[name]), logged[name], rtol=1e-5, atol=1e-5, err_msg=name)
    _grads_close(grads, trainer.model)

    # the default: NLL over the chosen responses only
    with torch.no_grad():
        nll_sum, count = 0.0, 0
        for p in pairs:
            ids = torch.from_numpy(np.concatenate([p.prompt, p.chosen]).astype(np.int64))[None]
            logp = torch.log_softmax(trainer.model(ids).logits[0, :-1].double(), -1)
            targets = ids[0, 1:]
            start = max(len(p.prompt), 1) - 1
            nll_sum -= logp[torch.arange(len(targets)), targets][start:].sum().item()
            count += len(targets) - start
    default, _, default_metrics = loss_and_grads(graphdef, lora, frozen, batch, None, 16,
                                                 Preference("orpo", orpo_lambda=0.25))
    np.testing.assert_allclose(float(default_metrics["nll_loss"]), nll_sum / count, rtol=1e-5)
    np.testing.assert_allclose(float(default), nll_sum / count - 0.25 * logged["log_odds_ratio"], rtol=1e-5)
