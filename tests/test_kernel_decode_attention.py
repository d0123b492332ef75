"""The decoding step's attention kernel (pallas_kernels/decode_attention.py): interpret mode against float64 on
caches filled to several points (left padding, an empty tail, a ring that wrapped), grouped query heads, sliding
windows and attention sinks; and its lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention, decode_attention_reference


def _float64(q, k, v, q_seg, kv_seg, q_index, window, ring, sinks):
    b, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b, hq, d))
    for r in range(b):
        for h in range(hq):
            kk, vv = k[r, :, h // g].astype(np.float64), v[r, :, h // g].astype(np.float64)
            scores = kk @ q[r, h].astype(np.float64) / np.sqrt(d)
            idx = np.arange(s)
            dist = (q_index - idx) % s if ring else q_index - idx
            visible = (kv_seg[r] == q_seg[r]) & (dist >= 0)
            if window is not None:
                visible &= dist < window
            logits = scores[visible]
            extra = [] if sinks is None else [float(sinks[h])]
            top = max([logits.max(), *extra])
            w = np.exp(logits - top)
            out[r, h] = w @ vv[visible] / (w.sum() + sum(np.exp(e - top) for e in extra))
    return out


@pytest.mark.parametrize("b, hq, hkv, s, d, q_index, window, ring, sinks, splits", [
    (3, 8, 2, 96, 32, 50, None, False, False, None),  # grouped heads, an empty tail
    (2, 4, 4, 64, 16, 63, 8, False, True, 2),  # a window, sinks, a full cache
    (2, 6, 2, 80, 64, 17, None, True, False, 3),  # a ring: every entry filled in time order mod S
    (1, 2, 1, 128, 128, 70, 24, True, True, None),  # a ring with a window across the wrap
    (4, 16, 2, 48, 16, 5, None, False, False, 1),  # 8 query heads per KV head, few filled entries
])
def test_decode_attention_equals_float64(b, hq, hkv, s, d, q_index, window, ring, sinks, splits):
    rng = np.random.default_rng(b * s + d)
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, s, hkv, d)).astype(np.float32)
    q_seg = np.ones(b, np.int32)
    kv_seg = np.ones((b, s), np.int32)
    for r in range(b):  # left padding of each row's prompt, and entries of another segment (a ring's old row)
        kv_seg[r, :r + 1] = 0
        if ring:
            kv_seg[r, (q_index + 1 + r) % s] = 2
    sink = rng.standard_normal(hq).astype(np.float32) if sinks else None
    want = _float64(q, k, v, q_seg, kv_seg, q_index, window, ring, sink)
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_seg), jnp.asarray(kv_seg),
            jnp.int32(q_index))
    options = dict(window=window, ring=ring, sinks=None if sink is None else jnp.asarray(sink))
    got = decode_attention(*args, **options, splits=splits, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(decode_attention_reference(*args, **options)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b, hq, hkv, s, d, window", [(64, 32, 8, 768, 128, None), (16, 64, 8, 4096, 64, 128),
                                                      (8, 32, 16, 1040, 256, 1024), (8, 32, 4, 1040, 512, None)])
def test_decode_attention_lowers_for_cuda(cuda_export, b, hq, hkv, s, d, window):
    """Llama-3-8B's 64-row rollout, gpt-oss's windowed heads of 64, Gemma 4's sliding (256) and full (512) heads."""
    shapes = [jax.ShapeDtypeStruct((b, hq, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16), jax.ShapeDtypeStruct((b,), jnp.int32),
              jax.ShapeDtypeStruct((b, s), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32)]
    text = cuda_export(lambda *a: decode_attention(*a, window=window), *shapes)
    assert "decode_attention" in text


def test_greedy_decoding_through_the_kernel_is_transformers(tmp_path, monkeypatch):
    """gpt-oss (sinks; sliding and full layers), a prompt longer than the window: greedy tokens with every decoding
    step's attention in the kernel (interpret mode), on the stacked, per-layer and ring caches, are transformers'."""
    from transformers import GptOssConfig

    import jaxtune
    from conftest import assert_greedy_tokens_are_transformers, build_hf_model
    from jaxtune.ops import dispatch

    calls = []
    import pallas_kernels.decode_attention as kernel

    real = kernel.decode_attention
    monkeypatch.setattr(kernel, "decode_attention", lambda *a, **kw: calls.append(kw["ring"]) or real(*a, **kw))
    hf = build_hf_model(GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=8), tmp_path)
    model, _ = jaxtune.from_pretrained(tmp_path, dtype="float32")
    monkeypatch.setattr(dispatch, "_mode", "pallas-interpret")
    prompts = [[int(i) for i in np.random.default_rng(5).integers(0, 128, 13)], [7, 8]]
    assert_greedy_tokens_are_transformers(model, hf, prompts, monkeypatch, max_new_tokens=6)
    assert False in calls and True in calls  # the static caches' steps and the ring's
