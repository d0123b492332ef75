"""A random bf16 HF checkpoint of a Qwen3.5, gpt-oss or Gemma 4 shape, built by transformers itself on the GPU.

The families' tensors (Gated DeltaNet projections, conv, A_log, dt_bias, fused expert stacks, sinks, routers) are
laid out by transformers' own modeling code, so both sides of a benchmark read the same files transformers writes.
Weights are transformers' initialisation (N(0, 0.02) projections, its A_log / dt_bias draws); `--layers` keeps the
model's per-layer shapes on fewer layers (Qwen3.5's 3:1 linear / full pattern, gpt-oss's alternation, Gemma 4's 5:1
sliding / full pattern are kept).

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
    # gpt-oss-20b as released (GptOssConfig's defaults are 120b's: 36 layers, 128 experts)
    "gpt-oss-20b": dict(model_type="gpt_oss", num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4),
    # Gemma 4 at the published sizes' shapes as this page assumes them (hidden, layers, heads, the full layers'
    # 512-wide heads and fewer KV heads with keys as values); no per-layer inputs
    "gemma4-31b": dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
                       num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
                       hidden_size_per_layer_input=0, vocab_size=262144),
    "gemma4-26b-a4b": dict(model_type="gemma4_text", hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
                           num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=1024,
                           hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128, top_k_experts=8,
                           moe_intermediate_size=704, vocab_size=262144),
}


def config(name: str, layers: int | None):
    """transformers' config of `name`, on `layers` decoder layers (each family's pattern of layer kinds kept)."""
    from transformers import Gemma4TextConfig, GptOssConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

    fields = dict(MODELS[name])
    kind = fields.pop("model_type")
    n = layers or fields.get("num_hidden_layers", 24)
    if kind == "gpt_oss":
        return GptOssConfig(**{**fields, "num_hidden_layers": n,
                               "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(n)]})
    if kind == "gemma4_text":
        return Gemma4TextConfig(**{**fields, "num_hidden_layers": n,
                                   "layer_types": ["full_attention" if (i + 1) % 6 == 0 or i == n - 1
                                                   else "sliding_attention" for i in range(n)]})
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
