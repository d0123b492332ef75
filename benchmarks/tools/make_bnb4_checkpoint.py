"""A random Llama-family checkpoint written directly in bitsandbytes' 4-bit HF layout, shard by shard.

A bf16 70B is 140 GB and cannot exist on a 64 GB disk; this writes the NF4 form (~40 GB for Llama-3-70B) without
any full-precision intermediate: each projection is drawn on the GPU as N(0, 0.02) in bf16 (the scale of trained
Llama weights, so activations and losses stay finite), quantized exactly as bitsandbytes does
(`jaxtune.quant.nf4.to_bnb`: NF4 codes, double-quantized absmax), and written with the layer's other tensors into one
safetensors shard. Embeddings, norms and lm_head are bf16, as in Unsloth's `-bnb-4bit` checkpoints. The directory
has a `quantization_config`, an index and a word-level tokenizer, so transformers / Unsloth and jaxtune load the
same weights.

    PYTHONPATH=. python3 benchmarks/tools/make_bnb4_checkpoint.py --model llama3-70b /tmp/bnb4_llama3-70b
Prints one JSON line: seconds, bytes on disk, peak host RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from convert.moe_names import expert_layout
from convert.safetensors_writer import write_shards
from jaxtune.quant import nf4

# HF config fields of each shape (Llama-3.x and Qwen3 dense); vocab sizes as released
MODELS: dict[str, dict] = {
    "llama3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "llama3.2-3b": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                        num_attention_heads=24, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        tie_word_embeddings=True),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                        tie_word_embeddings=True),
    "qwen3-14b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      rope_theta=1000000.0),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      rope_theta=1000000.0),
    # mixtures of experts: every layer sparse (Qwen3-30B-A3B: 128 experts, 8 per token; Mixtral: 8, 2 per token)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          rope_theta=1000000.0, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1000000.0,
                         num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, rope_theta=10000.0,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True),
    "small": dict(model_type="llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, vocab_size=2048, rope_theta=10000.0),
    "tiny": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512, rope_theta=10000.0),
}
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
WEIGHT_STD = 0.02
SHARD_BYTES = 4 * 2**30


def hf_config(name: str) -> dict:
    c = dict(MODELS[name])
    c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "mixtral": "MixtralForCausalLM"}[c["model_type"]]
    return {
        "architectures": [arch], "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": c["vocab_size"] - 2,
        "eos_token_id": c["vocab_size"] - 1, "attention_bias": False,
        **c,
        "quantization_config": {
            "quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": ["lm_head"],
        },
    }


def _shapes(c: dict) -> dict[str, tuple[int, int]]:
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def _normal(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * WEIGHT_STD).astype(jnp.bfloat16)


def _bf16(a: jax.Array) -> np.ndarray:
    return np.asarray(a).astype(ml_dtypes.bfloat16)


def save_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer ("w0 w1 ...") over the model's vocabulary, with a chat template: no hub needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 3)}
    vocab.update({"<unk>": vocab_size - 3, "<s>": vocab_size - 2, "</s>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} </s> {% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # not a class guessed from the model's config.json
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=1)


def _tensors(c: dict, seed: int, bf16: bool, progress: bool) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of the checkpoint in HF order, drawn one projection at a time."""
    key = jax.random.key(seed)
    h, vocab = c["hidden_size"], c["vocab_size"]
    key, k_embed, k_head = jax.random.split(key, 3)
    yield "model.embed_tokens.weight", _bf16(_normal(k_embed, (vocab, h)))
    shapes = _shapes(c)
    ones = np.ones(h, ml_dtypes.bfloat16)
    experts = c.get("num_experts") or c.get("num_local_experts")
    module, hub_names = expert_layout(c["model_type"])
    for layer in tqdm(range(c["num_hidden_layers"]), desc="writing", unit="layer", disable=not progress):
        prefix = f"model.layers.{layer}"
        weights = [(f"{prefix}.{parent}.{proj}", shapes[proj]) for parent, proj in PROJECTIONS
                   if not (experts and parent == "mlp")]
        if experts:  # the hub layout: one tensor per expert and projection, the router in bf16
            key, k = jax.random.split(key)
            yield f"{prefix}.{module}.gate.weight", _bf16(_normal(k, (experts, h)))
            i = c["moe_intermediate_size" if c["model_type"] == "qwen3_moe" else "intermediate_size"]
            moe_shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
            weights += [(f"{prefix}.{module}.experts.{e}.{hub_names[proj]}", moe_shapes[proj])
                        for e in range(experts) for proj in ("gate_proj", "up_proj", "down_proj")]
        for name, shape in weights:
            key, k = jax.random.split(key)
            w = _normal(k, shape)
            if bf16:
                yield f"{name}.weight", _bf16(w)
                continue
            for suffix, array in nf4.to_bnb(w).items():
                yield (f"{name}.weight.{suffix}" if suffix != "weight" else f"{name}.weight"), array
        yield f"{prefix}.input_layernorm.weight", ones
        yield f"{prefix}.post_attention_layernorm.weight", ones
        if c["model_type"] in ("qwen3", "qwen3_moe"):
            norm = np.ones(c["head_dim"], ml_dtypes.bfloat16)
            yield f"{prefix}.self_attn.q_norm.weight", norm
            yield f"{prefix}.self_attn.k_norm.weight", norm
    yield "model.norm.weight", ones
    if not c.get("tie_word_embeddings"):
        yield "lm_head.weight", _bf16(_normal(k_head, (vocab, h)))


def random_model(name: str, seed: int = 0):
    """The model of checkpoint `name` with random N(0, 0.02) NF4 projections, built on the device layer by layer
    (no checkpoint on disk: a mixture of experts' tens of thousands of expert tensors would take minutes to
    write and read); each expert quantized on its own as the loader does. Embeddings, norms, router in bf16."""
    from convert.load import abstract_state
    from convert.state_tree import merge_filled
    from jaxtune.models.config import ModelConfig
    from jaxtune.qlora import _quantize_experts, _quantize_stack

    cfg = ModelConfig.from_hf(hf_config(name))
    graphdef, state, pure, expected = abstract_state(cfg, jnp.bfloat16, True)
    key, values = jax.random.key(seed), {}
    layers = cfg.num_layers
    for path, sds in tqdm(list(expected.items()), desc="random model", unit="array"):
        key, k = jax.random.split(key)
        if path[-1] in ("absmax_codes", "nested_absmax", "offset", "nested_map"):
            continue  # filled with the codes
        if path[-1] == "codes":
            *lead, out, half = sds.shape
            quantize = _quantize_experts if len(lead) == 2 else _quantize_stack
            parts = []
            for layer in range(layers):  # one layer's bf16 weights alive at a time
                w = _normal(jax.random.fold_in(k, layer), (1, *lead[1:], out, half * 2))
                parts.append(quantize(w))
            q = jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
            for field in ("codes", "absmax_codes", "nested_absmax", "offset", "nested_map"):
                values[path[:-1] + (field,)] = getattr(q, field)
            del parts, q
        elif "norm" in path[-2]:
            values[path] = jnp.ones(sds.shape, sds.dtype)
        else:
            values[path] = _normal(k, sds.shape).astype(sds.dtype)
    return merge_filled(graphdef, state, pure, values)


def write_checkpoint(name: str, out: str, seed: int = 0, progress: bool = True, bf16: bool = False,
                     layers: int | None = None) -> dict:
    """Writes the random checkpoint `name` to `out` (through a temporary directory renamed at the end): bnb-4bit,
    or with `bf16` the plain bf16 HF checkpoint of the same draws (for conversion benchmarks)."""
    if os.path.exists(out):
        raise SystemExit(f"{out} already exists; choose a new output directory or delete it first")
    c = hf_config(name)
    if bf16:
        del c["quantization_config"]
    if layers:  # the model's first `layers` layers: its per-layer shapes on a smaller disk
        c["num_hidden_layers"] = layers
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    t0 = time.perf_counter()
    write_shards(tmp, _tensors(c, seed, bf16, progress), metadata={"format": "pt"}, shard_bytes=SHARD_BYTES)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    save_tokenizer(tmp, c["vocab_size"])
    os.rename(tmp, out)
    return {"model": name, "path": out, "format": "bf16" if bf16 else "bnb-4bit",
            "write_s": round(time.perf_counter() - t0, 1),
            "disk_gib": round(sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 2**30, 2),
            "host_rss_peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory (must not exist)")
    ap.add_argument("--model", default="llama3-70b", choices=list(MODELS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="plain bf16 projections (an HF checkpoint to convert)")
    ap.add_argument("--layers", type=int, help="only this many decoder layers (the same shapes, less disk)")
    args = ap.parse_args()
    print(json.dumps(write_checkpoint(args.model, args.out, args.seed, bf16=args.bf16, layers=args.layers)), flush=True)


if __name__ == "__main__":
    main()
