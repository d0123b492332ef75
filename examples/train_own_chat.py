"""QLoRA fine-tuning on your own JSONL chat file: one {"messages": [{"role": ..., "content": ...}, ...]} per line.

    python examples/train_own_chat.py my_chats.jsonl --model smollm2 --out runs/mine --steps 100
The adapter is saved in PEFT format to OUT/adapter; the run (metrics.jsonl, loss.png, checkpoints) in OUT/run.
"""

from __future__ import annotations

import argparse
import os

import jax

import jaxtune


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="JSONL file of chat rows")
    ap.add_argument("--model", default="smollm2", help="HF directory, jaxtune checkpoint, .gguf, or smollm2")
    ap.add_argument("--out", default="runs/own-chat")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq-len", type=int, default=1024)
    args = ap.parse_args()
    dtype = "float32" if jax.local_devices()[0].platform == "cpu" else "bfloat16"
    model, tokenizer = jaxtune.from_pretrained(args.model, dtype=dtype, load_in_4bit=True)
    jaxtune.get_peft_model(model, r=16, lora_alpha=32)
    config = jaxtune.TrainConfig(format="chat", seq_len=args.seq_len, micro_batch_size="auto", max_steps=args.steps,
                                 learning_rate=2e-4, warmup_steps=min(10, args.steps // 10), eval_fraction=0.05,
                                 eval_steps=max(1, args.steps // 5), save_steps=max(1, args.steps // 4))
    result = jaxtune.train(model, tokenizer, args.data, config, out_dir=os.path.join(args.out, "run"),
                           base_model=args.model)
    jaxtune.save_peft(model, os.path.join(args.out, "adapter"), base_model_name_or_path=args.model)
    print(f"trained {result.steps} steps (final loss {result.losses[-1]:.3f}); adapter in {args.out}/adapter")


if __name__ == "__main__":
    main()
