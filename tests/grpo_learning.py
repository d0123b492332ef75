"""A learnable GRPO task run by TRL's GRPOTrainer and by jaxtune with the same settings, for comparing learning
curves (tests/test_grpo_learning.py, and `python tests/grpo_learning.py` for the whole 60-step comparison).

A tiny random Llama (weights N(0, 0.5): a peaked policy), a word-level tokenizer, six-word prompts; the reward is
the share of a completion's words from the lowest quarter of the vocabulary. LoRA on all 7 projections, float32,
one prompt's group per step, TRL's default optimizer and schedule (AdamW, linear decay, no warmup).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

WORDS = 256  # the vocabulary's words; ids 0..2 are the special tokens
SPECIALS = ["<pad>", "<s>", "</s>"]


def save_word_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)


def low_words(completions, **_) -> list[float]:
    """The share of a completion's words from the lowest quarter of the vocabulary (w0 .. w15)."""
    scores = []
    for text in completions:
        words = text.split()
        scores.append(float(np.mean([w.startswith("w") and int(w[1:]) < WORDS // 4 for w in words])) if words else 0.0)
    return scores


def make_task(path: str, seed: int = 0, prompts: int = 64) -> list[dict[str, Any]]:
    """A random Llama (N(0, 0.5) weights) and its tokenizer saved in `path`; the prompt rows."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    save_word_tokenizer(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=WORDS + len(SPECIALS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.5 * torch.randn_like(p))
    model.save_pretrained(path)
    rng = np.random.default_rng(seed)
    return [{"prompt": " ".join(f"w{i}" for i in rng.integers(0, WORDS, 6))} for _ in range(prompts)]


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_trl(path: str, rows: list[dict], seed: int, steps: int, lr: float = 2e-2, out: str | None = None) -> list[dict]:
    """TRL's GRPOTrainer on CPU: 8 completions of 8 tokens of one prompt a step; its logged metrics per step."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    args = GRPOConfig(output_dir=out or os.path.join(path, f"trl-{seed}"), per_device_train_batch_size=8,
                      num_generations=8, max_completion_length=8, learning_rate=lr, max_steps=steps, logging_steps=1,
                      report_to=[], use_cpu=True, seed=seed, save_strategy="no", bf16=False, fp16=False,
                      disable_tqdm=True, dataloader_num_workers=0)
    trainer = GRPOTrainer(model=model, reward_funcs=[low_words], args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer,
                          peft_config=LoraConfig(r=16, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # (its log lines)
    trainer.train()
    return [h for h in trainer.state.log_history if "reward" in h]


def run_jaxtune(path: str, rows: list[dict], seed: int, steps: int, lr: float = 2e-2, load_in_4bit: bool = False,
                **options) -> list[dict]:
    """jaxtune's GRPO on the same task with its defaults (TRL's: AdamW, linear decay; the base in float32, not NF4,
    unless `load_in_4bit`)."""
    import jaxtune

    model, tokenizer = jaxtune.from_pretrained(path, dtype="float32", load_in_4bit=load_in_4bit)
    config = jaxtune.TrainConfig(**{**dict(
        objective="grpo", num_generations=8, max_completion_length=8, micro_batch_size=8, seq_len=24,
        learning_rate=lr, max_steps=steps, lora_r=16, lora_alpha=16, seed=seed), **options})
    records = []
    jaxtune.train(model, tokenizer, rows, config, reward_funcs=[low_words], progress=False, callback=records.append)
    return records


def _tail_mean(records: list[dict], key: str, last: int = 10) -> float:
    return float(np.mean([r[key] for r in records[-last:]]))


if __name__ == "__main__":
    import tempfile

    seeds = [int(s) for s in (sys.argv[1:] or ["0", "1", "2"])]
    with tempfile.TemporaryDirectory() as tmp:
        rows = make_task(tmp)
        out = {}
        for seed in seeds:
            trl_log, ours = run_trl(tmp, rows, seed, 60), run_jaxtune(tmp, rows, seed, 60)
            out[seed] = {side: {"first": log[0]["reward"], "at20": _tail_mean(log[:20], "reward"),
                                "last10": _tail_mean(log, "reward"),
                                "entropy_first": log[0]["entropy"], "entropy_last10": _tail_mean(log, "entropy")}
                         for side, log in (("trl", trl_log), ("jaxtune", ours))}
            print(seed, json.dumps(out[seed]), flush=True)
