"""DPO and ORPO equal TRL's own trainers (losses, logged rewards, LoRA gradients) on tiny random models, and
preference data is tokenized as TRL tokenizes it."""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
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


def _batch(pairs, seq_len=96, share_prompt=True):
    packed = pack_pairs(pairs, seq_len, share_prompt=share_prompt)
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


@pytest.mark.parametrize("hf_cls, loss_type, smoothing, share_prompt", [
    (LlamaConfig, "sigmoid", 0.0, True),
    (Qwen2Config, "sigmoid", 0.0, False),
    (LlamaConfig, "ipo", 0.0, True),
    (Qwen2Config, "robust", 0.1, True),
])
def test_dpo_loss_rewards_and_grads_equal_trl(tiny_tokenizer, tmp_path, hf_cls, loss_type, smoothing, share_prompt):
    """TRL's DPOTrainer copies the adapters it is given as its reference ("ref"); the policy then gets other
    random adapters, so rewards are non-zero. jaxtune gets the same two adapter sets, its rows with each prompt
    run once (the default) or twice."""
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
                                                            objective))(_batch(pairs, share_prompt=share_prompt))
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


def _trl_orpo_batch(trainer, n: int):
    """The first n rows of ORPOTrainer's own tokenized dataset, collated by its own collator."""
    rows = [trainer.train_dataset[i] for i in range(n)]
    return trainer.data_collator(rows)


def test_orpo_rows_tokenize_as_trls_orpo_trainer(tiny_tokenizer, tmp_path):
    """Plain-text pairs: the same ids as TRL's ORPOTrainer, its BOS before the prompt included (this tokenizer, like
    SmolLM2's, adds none itself). Chat pairs: TRL appends a second end-of-turn token after the template's own; jaxtune
    keeps the template's tokens (docs/training.md)."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    _, peft_model = _models(tiny_tokenizer, LlamaConfig, tmp_path / "hf")
    eos, bos = tiny_tokenizer.eos_token_id, tiny_tokenizer.bos_token_id
    for rows, extra_eos in ((ROWS, False), (CONVERSATIONAL + IMPLICIT_PROMPT, True)):
        args = ORPOConfig(output_dir=str(tmp_path / "trl"), bf16=False, report_to=[], use_cpu=True, max_length=512)
        trainer = ORPOTrainer(model=peft_model, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tiny_tokenizer)
        pairs = encode_pairs([Row(r, f"row {i}") for i, r in enumerate(rows)], tiny_tokenizer, "orpo")
        for want, got in zip(trainer.train_dataset, pairs):
            assert got.prompt[0] == bos
            for side in ("chosen", "rejected"):
                ours = np.concatenate([got.prompt, getattr(got, side)]).tolist()
                theirs = want[f"{side}_input_ids"]
                if extra_eos:
                    assert theirs[-1] == eos and ours[-1] != eos, (theirs, ours)
                    theirs = theirs[:-1]
                assert ours == theirs
                assert want[f"{side}_labels"].count(-100) == len(got.prompt)  # the response starts where TRL's does


@pytest.mark.parametrize("hf_cls, share_prompt", [(LlamaConfig, True), (Qwen2Config, False)])
def test_orpo_loss_rewards_and_grads_equal_trl(tiny_tokenizer, tmp_path, hf_cls, share_prompt):
    """End to end on TRL's own tokenization and batches: TRL's ORPOTrainer takes its NLL over the chosen prompt
    and response (jaxtune: train_on_all=True); the default NLL (responses only) is checked against torch's
    cross-entropy of the same logits."""
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    model, peft_model = _models(tiny_tokenizer, hf_cls, tmp_path / "hf")
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), beta=0.25, bf16=False, report_to=[], use_cpu=True,
                      per_device_train_batch_size=len(ROWS))
    trainer = ORPOTrainer(model=peft_model, args=args, train_dataset=Dataset.from_list(ROWS),
                          processing_class=tiny_tokenizer)
    pairs = encode_pairs([Row(r, f"row {i}") for i, r in enumerate(ROWS)], tiny_tokenizer, "orpo")
    trainer.model.train()
    loss, logged = trainer.get_batch_loss_metrics(trainer.model, _trl_orpo_batch(trainer, len(ROWS)))
    loss.backward()

    graphdef, lora, frozen = split_model(model)
    batch = _batch(pairs, share_prompt=share_prompt)
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


def _rows(tmp_path, rows):
    import json

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row, message", [
    ({"prompt": "hi", "chosen": "yes"}, "pairs.jsonl:2: missing field 'rejected'"),
    ({"prompt": "hi", "chosen": "  ", "rejected": "no"}, "pairs.jsonl:2: the chosen response is empty"),
    ({"chosen": "yes", "rejected": "no"}, "pairs.jsonl:2: missing field 'prompt'"),
    ({"prompt": "hi", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "no"},
     "pairs.jsonl:2: field 'rejected' is a str"),
])
def test_bad_preference_rows_are_refused_by_file_and_line(tmp_path, row, message):
    from jaxtune.data import read_rows
    from jaxtune.data.preference import check_preference_rows
    from jaxtune.data.sources import DataError

    with pytest.raises(DataError, match=message.replace("(", r"\(")):
        check_preference_rows(read_rows(_rows(tmp_path, [ROWS[0], row])))


def test_long_prompts_are_refused_or_dropped_and_long_pairs_cut(tiny_tokenizer, tmp_path):
    from jaxtune.data import read_rows
    from jaxtune.data.preference import encode_pairs, fit_pairs
    from jaxtune.data.sources import DataError

    long_prompt = {"prompt": "The quick brown fox jumps over the lazy dog. " * 8, "chosen": " yes", "rejected": " no"}
    pairs = encode_pairs(read_rows(_rows(tmp_path, [ROWS[0], long_prompt])), tiny_tokenizer)
    with pytest.raises(DataError, match=r"pairs.jsonl:2: the prompt \(\d+ tokens\) leaves no room"):
        fit_pairs(pairs, 48)
    with pytest.warns(UserWarning, match="1 of 2 pairs were dropped"):
        kept = fit_pairs(pairs, 48, drop_long_prompts=True)
    assert [p.where for p in kept] == [pairs[0].where]
    n = len(pairs[0].prompt)
    for share, prompt_cost in ((False, 2 * n), (True, n + 1)):  # the prompt twice, or once and its last token
        with pytest.warns(UserWarning, match="were truncated"):
            cut = fit_pairs(pairs[:1], prompt_cost + 4, share_prompt=share)[0]
        assert len(cut.chosen) + len(cut.rejected) == 4 and len(cut.chosen) >= 1 and len(cut.rejected) >= 1


def test_identical_responses_are_counted_and_warned(tiny_tokenizer):
    same = {"prompt": "hello", "chosen": " world", "rejected": " world"}
    with pytest.warns(UserWarning, match="1 of 2 pairs have identical chosen and rejected"):
        encode_pairs([Row(ROWS[0], "a:1"), Row(same, "a:2")], tiny_tokenizer)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_packed_pairs_score_each_sequence_alone(tiny_tokenizer, tiny_qlora_model, share_prompt):
    """Several pairs share a row; each response's log-probability equals that of prompt + response run on its own,
    whether the row runs each prompt once (both responses attending to it) or twice."""
    from jaxtune.training.objectives import Preference

    rows = ROWS + [{"prompt": "Name a color.", "chosen": " Blue.", "rejected": " A dog is not a color."}]
    pairs = encode_pairs([Row(r, f"row {i}") for i, r in enumerate(rows)], tiny_tokenizer)
    packed = pack_pairs(pairs, 160, share_prompt=share_prompt)
    assert len(packed) < len(pairs) and packed.extra["pair_mask"].shape[1] > 1  # packing happened
    assert ("attention_ids" in packed.extra) == share_prompt
    width = sum(p.length(share_prompt) for p in pairs)
    assert int((packed.segment_ids > 0).sum()) == width  # the prompt once plus its last token, or twice
    model = tiny_qlora_model
    batch = {k: jnp.asarray(v) for k, v in packed.arrays().items()}
    _, (chosen, rejected) = Preference("dpo").sequence_logps(model, batch, None, 16)
    found = 0
    for r in range(len(packed)):
        for k in range(int(packed.extra["pair_mask"][r].sum())):
            c_ids = packed.input_ids[r][packed.segment_ids[r] == 2 * k + 1]
            pair = next(p for p in pairs if np.array_equal(np.concatenate([p.prompt, p.chosen]), c_ids))
            for got, answer in ((chosen[r, k], pair.chosen), (rejected[r, k], pair.rejected)):
                ids = np.concatenate([pair.prompt, answer])
                alone = np.asarray(jax.nn.log_softmax(model(ids[None])[0, :-1], -1))
                n = len(pair.prompt)
                want = alone[np.arange(n - 1, len(ids) - 1), ids[n:]].sum()
                np.testing.assert_allclose(float(got), want, rtol=1e-4)
            found += 1
    assert found == len(pairs)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_the_shared_prompt_trains_like_two_sequences(tiny_tokenizer, tiny_qlora_model, objective):
    """The loop end to end with one pair per row: the prompt run once gives the losses and adapters of the two
    separate sequences, step after step."""
    import copy

    rows = [{"prompt": f"Question {i}: is {i} even?", "chosen": " yes" if i % 2 == 0 else " no",
             "rejected": " maybe" * (1 + i % 2)} for i in range(8)]
    results = {}
    for share in (True, False):
        model = copy.deepcopy(tiny_qlora_model)
        cfg = jaxtune.TrainConfig(objective=objective, seq_len=64, micro_batch_size=2, max_steps=4,
                                  learning_rate=5e-3, lora_r=4, packing=False, share_prompt=share)
        results[share] = (jaxtune.train(model, tiny_tokenizer, rows, cfg, progress=False).losses,
                          nnx.state(model, nnx.LoRAParam))
    np.testing.assert_allclose(results[True][0], results[False][0], rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(results[True][1]), jax.tree.leaves(results[False][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4)  # Adam after 4 steps of 5e-3


def test_dpo_trains_and_a_resumed_run_on_the_precomputed_reference_gives_the_same_losses(tiny_tokenizer,
                                                                                          tiny_qlora_model, tmp_path):
    """The loop end to end: rewards logged under TRL's names, loss falls, and a run on the stored reference
    log-probabilities, interrupted and resumed, reproduces the uninterrupted run on the per-step reference (the
    stored values are read back, not recomputed from the resumed adapters)."""
    import copy
    import json
    import os
    import signal

    rows = [{"prompt": f"Question {i}: yes or no?", "chosen": " yes" * (1 + i % 3), "rejected": " no"} for i in range(24)]

    def config(precompute: bool) -> jaxtune.TrainConfig:
        return jaxtune.TrainConfig(objective="dpo", seq_len=64, micro_batch_size=2, grad_accum=2, max_steps=6,
                                   learning_rate=5e-3, lora_r=4, eval_fraction=0.2, eval_steps=3, save_steps=2,
                                   precompute_reference=precompute)

    def interrupt_at_4(record):
        if record["step"] == 4:
            os.kill(os.getpid(), signal.SIGINT)

    full = jaxtune.train(copy.deepcopy(tiny_qlora_model), tiny_tokenizer, rows, config(False), out_dir=tmp_path / "a",
                         progress=False)
    first = jaxtune.train(copy.deepcopy(tiny_qlora_model), tiny_tokenizer, rows, config(True), out_dir=tmp_path / "b",
                          progress=False, callback=interrupt_at_4)
    assert first.interrupted and first.steps == 4
    assert (tmp_path / "b" / "reference_logps.safetensors").exists()
    rest = jaxtune.train(copy.deepcopy(tiny_qlora_model), tiny_tokenizer, rows, config(True), out_dir=tmp_path / "b",
                         resume=True, progress=False)
    assert rest.steps == 6
    np.testing.assert_allclose(rest.losses, full.losses, rtol=1e-5)
    assert full.losses[0] == pytest.approx(np.log(2), abs=1e-4)  # fresh adapters: policy == reference
    assert min(full.losses[-3:]) < full.losses[0]
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("a", "b")}
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(records["a"][-1])
    assert records["a"][-1]["eval_rewards/accuracies"] >= 0.5 and "eval_loss" in records["a"][-1]
    assert [r["step"] for r in records["b"]] == [1, 2, 3, 4, 5, 6]
    assert records["b"][-1]["eval_loss"] == pytest.approx(records["a"][-1]["eval_loss"], rel=1e-5)


def test_a_prompt_merging_with_its_response_is_warned_once_naming_the_first_row(tiny_tokenizer):
    """"The qu" + "ick brown" tokenizes the join as one token: the response then starts a token early."""
    rows = [Row(ROWS[0], "a.jsonl:1"), Row({"prompt": "The qu", "chosen": "ick brown", "rejected": "ick dog"}, "a.jsonl:2"),
            Row({"prompt": "The lazy qu", "chosen": "ick fox", "rejected": "ick dog"}, "a.jsonl:3")]
    with pytest.warns(UserWarning, match=r"2 of 3 pairs have a prompt whose tokens are not a prefix.*first: a.jsonl:2"):
        pairs = encode_pairs(rows, tiny_tokenizer)
    assert [p.merged for p in pairs] == [False, True, True]
    full = tiny_tokenizer("The qu" + "ick brown" + tiny_tokenizer.eos_token)["input_ids"]
    assert np.concatenate([pairs[1].prompt, pairs[1].chosen]).tolist() == full
