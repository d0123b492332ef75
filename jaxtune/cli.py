"""The `jaxtune` command line: one subcommand per job; user errors print one line and exit 1."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> None:
    import jaxtune

    model, tokenizer = jaxtune.from_pretrained(args.model, dtype=args.dtype)
    if tokenizer is None:
        raise jaxtune.CheckpointError(f"{args.model} has no tokenizer files; add tokenizer.json to the model directory")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxtune", description="QLoRA fine-tuning of Llama-family models in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a model (HF directory, .gguf file, or 'smollm2')")
    gen.add_argument("model", help="HF model directory, .gguf file, or a bundled name (smollm2)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    gen.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="write a jaxtune checkpoint (pre-quantized NF4 by default) that loads fast")
    conv.add_argument("src", help="HF model directory (bf16/fp16/fp32 or bnb-4bit), .gguf file, or smollm2")
    conv.add_argument("dst", help="output directory (must not exist; written atomically)")
    conv.add_argument("--quantize", default="nf4", help="nf4 (default) or none")
    conv.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                      help="dtype of embeddings, norms and lm_head (and of all weights with --quantize none)")
    conv.set_defaults(func=_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    from jaxtune.errors import JaxtuneError

    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (JaxtuneError, NotImplementedError) as e:
        print(f"jaxtune: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("jaxtune: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
