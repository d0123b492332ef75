"""Model structure and components against independent references."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import LlamaConfig

from jaxtune.models.config import ModelConfig
from jaxtune.models.causal_lm import init_model, segment_positions
from jaxtune.models.rope import apply_rope, inverse_frequencies, rope_tables

SMALL = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)


def _count_ops(cfg: ModelConfig) -> dict[str, int]:
    graphdef, state = nnx.split(init_model(cfg, dtype="float32"))
    fwd = jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids))
    text = fwd.lower(state, jnp.zeros((1, 8), jnp.int32)).as_text()
    return {op: text.count(op) for op in ("stablehlo.dot_general", "stablehlo.while", "stablehlo.exponential")}


def test_layers_run_in_one_scan_so_program_size_does_not_grow_with_depth():
    shallow = _count_ops(SMALL)
    deep = _count_ops(dataclasses.replace(SMALL, num_layers=12))
    assert shallow == deep
    assert shallow["stablehlo.while"] == 1


@pytest.mark.parametrize("rope", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen3's long-context setting
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,  # gpt-oss's
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 40.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.3, "original_max_position_embeddings": 2048},
])
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                     rope_scaling=None if rope is None else {**rope, "rope_theta": 500000.0})
    cfg = ModelConfig.from_hf(hf.to_dict())
    if rope is None:
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
        if rope["rope_type"] == "yarn":  # transformers scales cos and sin by its attention factor
            assert cfg.rope_attention_factor == pytest.approx(scale, rel=1e-12)
            assert ModelConfig.from_hf({**hf.to_dict(), **cfg.to_hf()}) == cfg  # written back as it was read
    np.testing.assert_allclose(inverse_frequencies(cfg), ref.double().numpy(), rtol=3e-6)  # theirs in float32


@pytest.mark.parametrize("shape", [(1, 5, 3, 8), (2, 17, 4, 64), (3, 9, 1, 128)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_rotation_matches_float64_rotate_half(shape, dtype):
    """x * cos + rotate_half(x) * sin (HF's convention) in float64, at several head sizes and ragged lengths; the
    tables' halves are equal, as `apply_rope` assumes."""
    b, t, _, d = shape
    cfg = dataclasses.replace(SMALL, head_dim=d, rope_theta=10000.0)
    rng = np.random.default_rng(d + t)
    x = rng.standard_normal(shape).astype(np.float32)
    positions = rng.integers(0, 5000, (b, t))
    cos, sin = rope_tables(cfg, jnp.asarray(positions))
    np.testing.assert_array_equal(cos[..., : d // 2], cos[..., d // 2:])
    out = apply_rope(jnp.asarray(x, dtype), cos, sin)
    assert out.dtype == dtype
    got = np.asarray(out.astype(jnp.float32), np.float64)
    xr = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # the input as the kernel sees it
    c, s = (np.asarray(a, np.float64)[:, :, None, :] for a in (cos, sin))  # the tables (frequencies: test above)
    rotated = np.concatenate([-xr[..., d // 2:], xr[..., :d // 2]], axis=-1)
    want = xr * c + rotated * s
    tol = 1e-6 if dtype == jnp.float32 else 1e-2  # bf16 output: an 8-bit mantissa
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 4)


def test_config_round_trips_through_hf_dict():
    for cfg in [SMALL, dataclasses.replace(SMALL, model_type="qwen2", qkv_bias=True, tie_word_embeddings=True),
                dataclasses.replace(SMALL, rope_type="llama3", rope_factor=8.0, rope_theta=5e5)]:
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_segment_positions_restart_per_segment():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
    want = [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    np.testing.assert_array_equal(segment_positions(seg), want)


def test_gradients_flow_through_scanned_layers():
    model = init_model(SMALL, dtype="float32")
    ids = jnp.arange(16).reshape(2, 8) % 64

    def loss(m):
        return jnp.mean(m(ids) ** 2)

    grads = nnx.grad(loss)(model)
    g = np.asarray(grads.layers.mlp.down_proj.weight[...])
    assert g.shape == (2, 32, 48) and np.all(np.abs(g).sum(axis=(1, 2)) > 0)
    # the same loss computed with a per-layer remat policy gives the same gradient
    model.remat_policy = "full"
    g2 = np.asarray(nnx.grad(loss)(model).layers.mlp.down_proj.weight[...])
    np.testing.assert_allclose(g, g2, rtol=1e-5, atol=1e-7)


def test_single_sequence_rows_ignore_segment_ids_with_the_same_result_on_real_tokens():
    """One sequence per row, then padding: plain causal attention gives every real token what the
    segment-aware attention gives it (padding only follows the sequence), so the flag is exact."""
    model = init_model(SMALL, dtype="float32")
    ids = np.random.default_rng(0).integers(0, SMALL.vocab_size, (3, 16))
    seg = np.zeros((3, 16), np.int32)
    for row, n in enumerate((16, 11, 5)):
        seg[row, :n] = 1
    want = np.asarray(model.hidden_states(ids, segment_positions(seg), seg))
    model.single_sequence_rows = True
    got = np.asarray(model.hidden_states(ids, segment_positions(seg), seg))
    np.testing.assert_allclose(got[seg > 0], want[seg > 0], atol=1e-5)
    two = np.where(np.arange(16) < 8, 1, 2)[None].repeat(3, 0).astype(np.int32)
    flagged = np.asarray(model.hidden_states(ids, segment_positions(two), two))
    model.single_sequence_rows = False
    aware = np.asarray(model.hidden_states(ids, segment_positions(two), two))
    assert not np.allclose(flagged[:, 8:], aware[:, 8:], atol=1e-3)  # two segments a row: the flag must stay off


def test_long_context_mlp_tiles_bound_the_intermediate_size_and_split_evenly():
    """Long-context mode runs the MLP in token tiles of at most a fixed number of [tokens, intermediate] elements
    (wide 70B MLPs get half of 8B's tokens), split into equal tiles so an uneven length is not padded up to a
    whole extra tile; the tiled MLP equals the untiled one."""
    from jaxtune.models.causal_lm import MLP, offload_mlp_token_tile

    shapes = {"llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672), "llama3.2-1b": (2048, 8192)}
    tiles = {name: offload_mlp_token_tile(dataclasses.replace(SMALL, hidden_size=h, intermediate_size=i))
             for name, (h, i) in shapes.items()}
    assert tiles == {"llama3-8b": 16384, "llama3-70b": 8192, "llama3.2-1b": 28672}
    cfg = ModelConfig(model_type="llama", vocab_size=8, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=16)
    mlp = MLP(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    # 18,432 tokens in tiles of at most 8,192: three of 6,144, not two of 8,192 and one padded to 8,192
    jaxpr = str(jax.make_jaxpr(lambda x: mlp(x, token_tile=8192))(jax.ShapeDtypeStruct((1, 18432, 16), jnp.float32)))
    assert "length=3" in jaxpr and "f32[3,6144,16]" in jaxpr and "24576" not in jaxpr
    x = jax.random.normal(jax.random.key(0), (2, 300, 16), jnp.float32)
    np.testing.assert_allclose(np.asarray(mlp(x, token_tile=256)), np.asarray(mlp(x)), rtol=1e-5, atol=1e-6)


def test_per_layer_caches_decode_as_the_stacked_cache_with_adapters(tiny_qlora_model):
    """A GPU decodes with a KV cache per layer (one traced layer per decoder layer, `KVCache`): the same logits and
    cache contents as the stacked cache's layer loop, prefill and single-token steps, NF4 base and non-zero LoRA."""
    import jaxtune
    from jaxtune.models.causal_lm import KVCache

    model = tiny_qlora_model
    jaxtune.get_peft_model(model, r=4, lora_alpha=8)
    for _, b in nnx.iter_graph(model):
        if isinstance(b, nnx.LoRAParam) and b[...].ndim and b[...].shape[-1] == 4:
            b[...] = jax.random.normal(jax.random.key(1), b[...].shape, b[...].dtype) * 0.05
    ids = jax.random.randint(jax.random.key(2), (2, 9), 1, model.config.vocab_size)

    def run(per_layer: bool):
        cache = KVCache.empty(model.config, 2, 16, model.dtype, per_layer=per_layer)
        logits, cache = model.forward_with_cache(ids[:, :6], jnp.broadcast_to(jnp.arange(6), (2, 6)),
                                                 jnp.ones((2, 6), jnp.int32), cache, jnp.int32(0))
        out = [logits]
        for i in range(6, 9):
            step, cache = model.forward_with_cache(ids[:, i:i + 1], jnp.full((2, 1), i), jnp.ones((2, 1), jnp.int32),
                                                   cache, jnp.int32(i))
            out.append(step)
        return np.concatenate([np.asarray(o) for o in out], axis=1), cache

    (loop, stacked), (unrolled, per_layer) = run(False), run(True)
    assert isinstance(per_layer.k, tuple) and len(per_layer.k) == model.config.num_layers
    np.testing.assert_allclose(unrolled, loop, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.stack(per_layer.k), np.asarray(stacked.k), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.stack(per_layer.v), np.asarray(stacked.v), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(per_layer.segment_ids), np.asarray(stacked.segment_ids))
    assert np.abs(np.asarray(stacked.k)[:, :, :9]).max() > 0 and not np.asarray(stacked.k)[:, :, 9:].any()


def test_generation_with_per_layer_caches_samples_the_stacked_caches_tokens(tiny_qlora_model, monkeypatch):
    """The samplers' choice of cache (`per_layer_cache`, on a GPU per layer) changes no token, seeded sampling too."""
    import importlib

    decoding = importlib.import_module("jaxtune.generate")
    prompts = [[5, 9, 13, 2], [7, 3]]
    runs = {}
    for per_layer in (False, True):
        monkeypatch.setattr(decoding, "PER_LAYER_CACHE", per_layer)
        runs[per_layer] = [decoding.generate_tokens(tiny_qlora_model, prompts, max_new_tokens=6, temperature=t, seed=1)
                           for t in (0.0, 1.0)]
    assert runs[True] == runs[False] and all(len(row) == 6 for run in runs[True] for row in run)
