"""What quantization-aware training recovers of a 4-bit export's loss at Llama-3.2-1B's shapes (a GPU run; the
bundled SmolLM2's is `qat_smollm2.py`): a random model of those shapes (no hub) learns a table by LoRA, and each
export is scored on it.

    PYTHONPATH=.:examples:benchmarks python benchmarks/accuracy/qat_random_llama.py [--model llama3.2-1b] [--steps 300]
        [--out /tmp/qat1b] [--formats q4_0] [--base nf4|bf16]
The task: a prompt of one word of `--words`, the answer the next 8 words of a fixed random cycle through them (a table
the base model cannot know). The scored rows are drawn apart from the training rows, but their words' successors
occur in training: the score is how much of the learned table each model keeps, not generalization. The loss and the
exact match of greedy answers, of (a) the fine-tune in memory, (b) its 4-bit export, for the plain fine-tune and for
each QAT format (`qat_smollm2.compare`). `--base nf4` trains on the model quantized to NF4 at load (q4_0's case),
`--base bf16` on its bf16 weights (the case of a merged NF4 export).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import jaxtune
from benchmarks.tools.make_bnb4_checkpoint import write_checkpoint
from benchmarks.accuracy.qat_smollm2 import compare

CHAIN = 8


def cipher_rows(count: int, seed: int, words: int) -> list[dict]:
    """`count` prompts of one word w_s (s < words) with answers the next CHAIN words of a fixed random cycle through
    all the words (a table the base model cannot know; each answer word follows from the word before it)."""
    order = np.random.default_rng(1234).permutation(words)
    after = np.empty(words, np.int64)
    after[order] = np.roll(order, -1)
    rng = np.random.default_rng(seed)
    rows = []
    for start in rng.integers(0, words, count):
        chain, word = [], start
        for _ in range(CHAIN):
            word = after[word]
            chain.append(word)
        rows.append({"prompt": f"w{start}", "answer": " ".join(f"w{w}" for w in chain)})
    return rows


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_bpe_tokenizer(checkpoint: Path, words: int) -> None:
    """A byte-level BPE tokenizer trained on the task's words with a ChatML template, in place of the checkpoint's
    word-level one (GGUF export writes BPE tokenizers), and the config's special ids set to its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(f"w{i}" for i in range(words)), "user assistant"] * 4
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=words + 400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                                      "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (checkpoint / name).unlink(missing_ok=True)
    fast.save_pretrained(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    config.update(bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    (checkpoint / "config.json").write_text(json.dumps(config, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=5e-4,
                    help="peak rate; at 2e-3 the loss sits on a plateau near 4.6 and leaves it or not by chance "
                         "(benchmarks/results/2026-11-28-qat-llama1b-h200.md)")
    ap.add_argument("--words", type=int, default=512, help="words in the table's cycle (its size)")
    ap.add_argument("--out", default="/tmp/qat_random_llama")
    ap.add_argument("--formats", default="q4_0")
    ap.add_argument("--base", default="nf4", choices=["nf4", "bf16"])
    ap.add_argument("--layers", type=int, help="only this many decoder layers (a quick check)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--qat-start-step", type=int, default=0, help="QAT runs train plain LoRA before this step")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / f"{args.model}-bf16"
    if not (checkpoint / "config.json").exists():
        write_checkpoint(args.model, str(checkpoint), bf16=True, layers=args.layers)
        save_bpe_tokenizer(checkpoint, args.words)
    train = out / "cipher_train.jsonl"
    with open(train, "w") as f:
        for row in cipher_rows(4000, seed=0, words=args.words):
            chat = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["answer"]}]
            f.write(json.dumps({"messages": chat}) + "\n")
    evals = cipher_rows(32, seed=1, words=args.words)

    def load():
        return jaxtune.from_pretrained(checkpoint, load_in_4bit=args.base == "nf4", dtype=args.dtype)

    train_config = dict(format="chat", seq_len=64, micro_batch_size=16, max_steps=args.steps, learning_rate=args.lr,
                        schedule="cosine", warmup_steps=10, lora_r=16, lora_alpha=32)
    print(json.dumps({"model": args.model, "base": args.base, "steps": args.steps, "lr": args.lr, "words": args.words,
                      "qat_start_step": args.qat_start_step, "task": "cycle table"}), flush=True)
    compare(load, train, evals, train_config, [f for f in args.formats.split(",") if f], [], out,
            qat_start_step=args.qat_start_step)


if __name__ == "__main__":
    main()
