"""A random bf16 HF checkpoint of a hybrid Qwen3.5 shape, built by transformers itself on the GPU.

The Qwen3.5 families' tensors (Gated DeltaNet projections, conv, A_log, dt_bias, fused expert stacks) are laid out
by transformers' own modeling code, so both sides of a benchmark read the same files transformers writes. Weights
are transformers' initialisation (N(0, 0.02) projections, its A_log / dt_bias draws); `--layers` keeps the model's
per-layer shapes on fewer layers (the 3:1 linear / full pattern is kept).

    python3 benchmarks/tools/make_random_hf.py --model qwen3.5-9b --layers 8 /tmp/q35_9b
Prints one JSON line: seconds, bytes on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

# Qwen3.5 text shapes as released (transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig defaults are these)
MODELS: dict[str, dict] = {
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                       vocab_size=248320),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, vocab_size=248320),
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=256),
    "tiny-qwen3.5-moe": dict(model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, vocab_size=256),
}


def config(name: str, layers: int | None):
    """transformers' config of `name`, on `layers` decoder layers (every fourth one full attention)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    fields = dict(MODELS[name])
    kind = fields.pop("model_type")
    n = layers or fields["num_hidden_layers"]
    fields.update(num_hidden_layers=n, tie_word_embeddings=False, bos_token_id=fields["vocab_size"] - 2,
                  eos_token_id=fields["vocab_size"] - 1,
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)])
    cls = Qwen3_5TextConfig if kind == "qwen3_5_text" else Qwen3_5MoeTextConfig
    return cls(**fields)


def write_checkpoint(name: str, out: str, layers: int | None = None, seed: int = 0) -> dict:
    """Builds the model on the GPU (or CPU) in bf16 and saves it to `out` (a temporary directory renamed at the end),
    with the word-level tokenizer of make_bnb4_checkpoint.py."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from benchmarks.tools.make_bnb4_checkpoint import save_tokenizer

    if os.path.exists(out):
        raise SystemExit(f"{out} already exists; choose a new output directory or delete it first")
    cfg = config(name, layers)
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tmp, cfg.vocab_size)
    del model
    os.rename(tmp, out)
    return {"model": name, "path": out, "layers": cfg.num_hidden_layers, "write_s": round(time.perf_counter() - t0, 1),
            "disk_gib": round(sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 2**30, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory (must not exist)")
    ap.add_argument("--model", default="qwen3.5-9b", choices=list(MODELS))
    ap.add_argument("--layers", type=int, help="only this many decoder layers (the same shapes, less disk)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(write_checkpoint(args.model, args.out, args.layers, args.seed)), flush=True)


if __name__ == "__main__":
    main()
