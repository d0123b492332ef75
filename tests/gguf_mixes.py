"""The seeded random models whose GGUF type mixes the suite checks against llama-quantize's (recorded by
tests/data/make_llama_quantize_mixes.py): mixtures of experts with 8 experts (Mixtral's rules) and 4, and an
80-layer llama (llama.cpp's 70B class)."""

from __future__ import annotations

FTYPES = ("q8_0", "q6_k", "q4_k_m", "q4_0", "f16", "bf16")

# hidden 256 (whole K-quant super-blocks); 6 heads of 32 make attn_output's rows 192 wide (K-quant fallbacks)
_MOE = dict(vocab_size=0, hidden_size=256, intermediate_size=256, num_layers=4, num_heads=6, num_kv_heads=2,
            head_dim=32, moe_intermediate_size=256, num_experts_per_tok=2)
CASES = {
    "mixtral_8_experts": dict(_MOE, model_type="mixtral", num_experts=8),
    "qwen3_moe_8_experts": dict(_MOE, model_type="qwen3_moe", num_experts=8, qk_norm=True),
    "qwen3_moe_4_experts": dict(_MOE, model_type="qwen3_moe", num_experts=4, qk_norm=True),
    "llama_80_layers": dict(model_type="llama", vocab_size=0, hidden_size=256, intermediate_size=256,
                            num_layers=80, num_heads=4, num_kv_heads=1, head_dim=64),
}
BYTES_CASES = ("mixtral_8_experts", "qwen3_moe_4_experts")  # small enough for the suite to write every type


def mix_model(case: str, vocab_size: int, cases: dict | None = None):
    """The case's model in float32 (its weights exact in the f32 GGUF), every weight drawn by numpy from seed 0: the
    same bits whatever XLA's flags (jax's sampler compiled at another optimization level may differ in the last bit)."""
    import numpy as np
    from flax import nnx

    from jaxtune.models.config import ModelConfig
    from jaxtune.models.causal_lm import init_model

    cfg = ModelConfig(**{**(cases or CASES)[case], "vocab_size": vocab_size}, eos_token_id=2)
    model = init_model(cfg, dtype="float32", seed=0)
    rng = np.random.default_rng(0)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        norm = "norm" in str(path[-2])  # every Param's path ends in its module, then "weight"
        value = 1.0 + 0.1 * rng.standard_normal(shape) if norm else 0.05 * rng.standard_normal(shape)
        var.set_value(np.asarray(value, np.float32))
    return model


# dense models quantized with an importance matrix (tests/data/make_llama_quantize_imatrix.py): 16 layers, so that
# q4_0 puts the first two ffn_down in q4_1; Qwen3 rows 192 wide, so that q4_k_m falls back to q5_0 / q8_0
IMATRIX_FTYPES = ("q4_0", "q4_k_m", "q6_k")
IMATRIX_CASES = {
    "llama_16_layers": dict(model_type="llama", vocab_size=0, hidden_size=256, intermediate_size=512, num_layers=16,
                            num_heads=4, num_kv_heads=2, head_dim=64),
    "qwen3_192_wide": dict(model_type="qwen3", vocab_size=0, hidden_size=192, intermediate_size=256, num_layers=2,
                           num_heads=3, num_kv_heads=1, head_dim=64, qk_norm=True),
}


def imatrix_model(case: str, vocab_size: int):
    """The case's model, seeded as `mix_model`'s are."""
    return mix_model(case, vocab_size, IMATRIX_CASES)


def seeded_imatrix(model):
    """An importance matrix for every projection of `model` (sums over decades, one column never reached), drawn
    by numpy from seed 0: the same file whatever computes the model's activations."""
    import numpy as np

    from convert.gguf_export import _gguf_tensors
    from convert.imatrix import ImportanceMatrix
    from convert.merged import merged_tensors

    rng = np.random.default_rng(0)
    sums, counts = {}, {}
    for t in _gguf_tensors(list(merged_tensors(model, None)), model.config):
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        sums[t.name] = (np.exp(rng.normal(0, 1.5, t.shape[-1])) * 1000).astype(np.float32)
        sums[t.name][3] = 0.0
        counts[t.name] = 1000
    return ImportanceMatrix(sums, counts, chunk_size=512, chunk_count=2, datasets=["seeded"])
