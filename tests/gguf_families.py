"""The seeded gpt-oss fine-tunes whose GGUF the suite checks against llama.cpp's own logits of the same file
(recorded by tests/data/make_llama_cpp_gguf_logits.py, which builds llama.cpp; the suite does not)."""

from __future__ import annotations

import os

# hidden 64, expert width 96 (gate/up and down differ in shape), windows of 8 on rows of 24 tokens
GPT_OSS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
CASES = {
    "gpt_oss_yarn": GPT_OSS,  # gpt-oss's own YaRN (factor 32, ramp ends not rounded)
    "gpt_oss_plain_rope": dict(GPT_OSS, rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
}
IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200, 31, 77, 150, 9, 280, 46, 13, 190, 58, 222, 36, 101, 4]


def family_gguf(case: str, tokenizer, tmp: str) -> tuple[str, str]:
    """(the GGUF, the merged HF directory) of the case: a random HF model (torch seed 0), its float32 jaxtune model
    with LoRA r=8 on every projection drawn by numpy (seed 1) as multiples of 1/256, so that B @ A is exact in
    float32 whatever order a BLAS sums it in, merged onto the original weights and written as an f32 GGUF named
    "gguf-case": the same bytes on every machine."""
    import numpy as np
    from flax import nnx

    import jaxtune
    from transformers import GptOssConfig

    from conftest import build_hf_model

    base = os.path.join(tmp, f"{case}-base")
    build_hf_model(GptOssConfig(**{**CASES[case], "vocab_size": len(tokenizer)}), base)
    tokenizer.save_pretrained(base)
    model, tok = jaxtune.from_pretrained(base, dtype="float32")
    jaxtune.get_peft_model(model, r=8, lora_alpha=16)
    rng = np.random.default_rng(1)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        var.set_value(np.asarray(rng.integers(-8, 9, var.get_value().shape) / 256, np.float32))
    path, merged = os.path.join(tmp, f"{case}.gguf"), os.path.join(tmp, f"{case}-merged")
    jaxtune.save_gguf(model, path, tokenizer=tok, base=base, gguf_type="f32", name="gguf-case")
    jaxtune.save_merged(model, merged, base=base, dtype="float32")
    return path, merged
