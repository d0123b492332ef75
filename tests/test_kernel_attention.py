"""Flash attention kernel: interpret mode vs a float64 numpy reference (outputs and dq/dk/dv), CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas.triton import CUSTOM_CALL_TARGET_NAME as CUSTOM_CALL

from pallas_kernels.flash_attention import AttentionTiles, attention_reference, flash_attention


def numpy_attention(q, k, v, do, segment_ids=None, window=None, shared_prefix=False, sinks=None):
    """float64 softmax attention and its gradients, written out by hand (independent of jax); with sinks [Hq] a
    logit per head in each row's normalizer (and its gradient last)."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    k_r, v_r = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head h reads kv head h // g
    scale = d**-0.5
    s = np.einsum("bthd,bshd->bhts", q, k_r) * scale
    i = np.arange(t)
    mask = (i[:, None] >= i[None, :])[None, None]
    if window is not None:
        mask = mask & ((i[:, None] - i[None, :]) < window)[None, None]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        q_seg, k_seg = seg[:, None, :, None], seg[:, None, None, :]
        visible = q_seg == k_seg
        if shared_prefix:  # a branch -2p / -2p-1 also sees the prompt run p
            visible = visible | ((q_seg < 0) & (k_seg == -q_seg // 2))
        mask = mask & visible
    s = np.where(mask, s, -np.inf)
    sink = None if sinks is None else np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                                                      (*s.shape[:-1], 1))
    top = s.max(-1, keepdims=True) if sink is None else np.maximum(s.max(-1, keepdims=True), sink)
    p = np.exp(s - top)
    norm = p.sum(-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - top))
    p /= norm
    out = np.einsum("bhts,bshd->bthd", p, v_r)
    dv_r = np.einsum("bhts,bthd->bshd", p, do)
    dp = np.einsum("bthd,bshd->bhts", do, v_r)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhts,bshd->bthd", ds, k_r) * scale
    dk_r = np.einsum("bhts,bthd->bshd", ds, q) * scale
    fold = lambda a: a.reshape(b, t, k.shape[2], g, d).sum(3)  # noqa: E731
    if sink is None:
        return out, dq, fold(dk_r), fold(dv_r)
    p_sink = (np.exp(sink - top) / norm)[..., 0]  # [b, h, t]
    dsinks = -(p_sink * (dp * p).sum(-1)).sum((0, 2))
    return out, dq, fold(dk_r), fold(dv_r), dsinks


def packed_ids(b, t, rng, max_len):
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        pos, seg = 0, 1
        while pos < t:
            n = int(rng.integers(1, max_len + 1))
            ids[row, pos : pos + n] = seg
            pos, seg = pos + n, seg + 1
        ids[row, t - t // 7 :] = 0  # trailing padding run, as packing leaves it
    return ids


def shared_prefix_ids(b, t, rng, max_len):
    """Rows of groups laid out as preference pairs: a prompt run p, then branches -2p and -2p-1 (a branch may be
    absent, a prompt may have one branch), plain positive runs between groups, trailing padding."""
    ids = np.zeros((b, t), np.int32)
    for row in range(b):
        pos, p = 0, 1
        while pos < t:
            lengths = rng.integers(1, max_len + 1, 3)
            runs = [p, -2 * p, -2 * p - 1][: int(rng.integers(1, 4))]
            for run, n in zip(runs, lengths):
                ids[row, pos:pos + n] = run
                pos += int(n)
            p += 1
        ids[row, t - t // 7:] = 0
    return ids[:, :t]


CASES = [
    # b, t, hq, hkv, d, segments, window
    (1, 1, 2, 2, 64, False, None),
    (2, 17, 4, 1, 64, False, None),
    (1, 256, 8, 1, 128, False, None),
    (1, 256, 4, 4, 64, True, None),
    (2, 100, 8, 2, 64, True, None),
    (1, 1000, 4, 1, 64, True, None),
    (1, 130, 4, 2, 64, False, 33),
    (2, 90, 6, 2, 64, True, None),  # a group of 3: dk/dv per query head, summed after
    (1, 70, 8, 1, 64, False, 40),  # a group of 8 summed inside the dk/dv kernel, with a window
    (1, 75, 4, 2, 256, True, 20),  # wide heads (Qwen3.5, Gemma 4's sliding layers) on packed rows with a window
    (2, 40, 2, 1, 512, False, None),  # Gemma 4's full layers
]


@pytest.mark.parametrize("b,t,hq,hkv,d,segments,window", CASES)
def test_flash_attention_matches_float64(b, t, hq, hkv, d, segments, window):
    rng = np.random.default_rng(t * 31 + hq)
    q, do = (rng.standard_normal((b, t, hq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, d)).astype(np.float32) for _ in range(2))
    seg = packed_ids(b, t, rng, max_len=max(2, t // 9)) if segments else None
    tiles = AttentionTiles(block_q=64, block_k=32, bwd_block_q=32, bwd_block_k=64)

    def f(q, k, v):
        return flash_attention(q, k, v, None if seg is None else jnp.asarray(seg), sliding_window=window,
                               tiles=tiles, interpret=True)

    out, vjp = jax.vjp(f, *(jnp.asarray(a) for a in (q, k, v)))
    grads = vjp(jnp.asarray(do))
    want = numpy_attention(q, k, v, do, seg, window)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("b,t,hq,hkv,d,segments,window", [c for c in CASES if c[1] > 1][:2] + CASES[-3:])
def test_attention_sinks_match_float64(b, t, hq, hkv, d, segments, window):
    """gpt-oss's sinks: a learned logit per query head in every row's normalizer. Outputs, dq/dk/dv and the sinks'
    own gradient against the float64 reference, on packed rows and windows."""
    rng = np.random.default_rng(t * 7 + hq)
    q, do = (rng.standard_normal((b, t, hq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, d)).astype(np.float32) for _ in range(2))
    sinks = rng.standard_normal(hq).astype(np.float32) * 2
    seg = packed_ids(b, t, rng, max_len=max(2, t // 9)) if segments else None
    tiles = AttentionTiles(block_q=64, block_k=32, bwd_block_q=32, bwd_block_k=64)

    def f(q, k, v, sinks):
        return flash_attention(q, k, v, None if seg is None else jnp.asarray(seg), sliding_window=window,
                               tiles=tiles, interpret=True, sinks=sinks)

    out, vjp = jax.vjp(f, *(jnp.asarray(a) for a in (q, k, v, sinks)))
    grads = vjp(jnp.asarray(do))
    want = numpy_attention(q, k, v, do, seg, window, sinks=sinks)
    for name, got, ref in zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), want):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=5e-5, rtol=2e-5, err_msg=name)
    ref = attention_reference(*(jnp.asarray(a) for a in (q, k, v)), None if seg is None else jnp.asarray(seg),
                              sliding_window=window, sinks=jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(ref, np.float64), want[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("b,t,hq,hkv,max_len", [(1, 64, 4, 2, 9), (2, 301, 8, 2, 60), (1, 700, 4, 1, 200),
                                                 (2, 130, 6, 2, 30)])
def test_shared_prefix_attention_matches_float64(b, t, hq, hkv, max_len):
    """Each branch sees its prompt and itself, never the other branch; tiles start at the prompt (queries) and
    run to the last branch (keys), so ragged runs across tile edges are the test."""
    rng = np.random.default_rng(t + hq)
    q, do = (rng.standard_normal((b, t, hq, 64)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, hkv, 64)).astype(np.float32) for _ in range(2))
    seg = shared_prefix_ids(b, t, rng, max_len)
    assert (seg < 0).any() and (seg > 0).any()
    tiles = AttentionTiles(block_q=32, block_k=16, bwd_block_q=16, bwd_block_k=32)

    def f(q, k, v):
        return flash_attention(q, k, v, jnp.asarray(seg), tiles=tiles, interpret=True, shared_prefix=True)

    out, vjp = jax.vjp(f, *(jnp.asarray(a) for a in (q, k, v)))
    grads = vjp(jnp.asarray(do))
    want = numpy_attention(q, k, v, do, seg, shared_prefix=True)
    for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, *grads), want):
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=2e-5, rtol=2e-5, err_msg=name)
    ref_jnp = attention_reference(*(jnp.asarray(a) for a in (q, k, v)), jnp.asarray(seg), shared_prefix=True)
    np.testing.assert_allclose(np.asarray(ref_jnp, np.float64), want[0], atol=2e-5, rtol=2e-5)


def test_a_branch_sees_only_its_prompt_and_itself():
    """The same rows with the other branch's values changed: a branch's outputs do not move."""
    rng = np.random.default_rng(5)
    seg = np.array([[1, 1, 1, -2, -2, -3, -3, -3, 2, -4, -5, 0]], np.int32)
    q, k, v = (rng.standard_normal((1, 12, 2, 64)).astype(np.float32) for _ in range(3))
    f = lambda k, v: np.asarray(flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),  # noqa: E731
                                                jnp.asarray(seg), interpret=True, shared_prefix=True))
    k2, v2 = k.copy(), v.copy()
    k2[:, 3:5], v2[:, 3:5] = 7.0, -7.0  # the first pair's chosen branch
    a, b = f(k, v), f(k2, v2)
    np.testing.assert_array_equal(a[:, 5:8], b[:, 5:8])  # its rejected branch
    np.testing.assert_array_equal(a[:, :3], b[:, :3])  # its prompt
    assert not np.allclose(a[:, 3:5], b[:, 3:5])


def test_flash_attention_bf16_close_to_float64():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 200, 8, 128)).astype(np.float32)
    k, v = (rng.standard_normal((1, 200, 1, 128)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, interpret=True), bf(q), bf(k), bf(v))
    grads = vjp(bf(do))
    rounded = [np.asarray(bf(a), np.float64) for a in (q, k, v, do)]
    for got, ref in zip((out, *grads), numpy_attention(*rounded)):
        assert got.dtype == jnp.bfloat16
        err = np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max()
        assert err < 2e-2


def test_flash_attention_rejects_unsupported_shapes():
    q = jnp.zeros((1, 8, 2, 96))
    with pytest.raises(ValueError, match="head_dim 64, 128, 256, 512, got 96"):
        flash_attention(q, q, q, interpret=True)
    with pytest.raises(ValueError, match="not a multiple"):
        flash_attention(jnp.zeros((1, 8, 3, 64)), jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2, 64)), interpret=True)
    with pytest.raises(ValueError, match="segment_ids"):
        flash_attention(jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8, 2, 64)),
                        jnp.zeros((1, 9), jnp.int32), interpret=True)


@pytest.mark.parametrize("t,segments,tiles", [
    (1000, False, AttentionTiles()),
    (2048, True, AttentionTiles()),
    (17, True, AttentionTiles()),
    (4096, False, AttentionTiles(128, 128, 8, 2, 128, 64, 8, 2)),
    (3000, "shared", AttentionTiles()),
])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (28, 4)])  # dk/dv summed over the group in the kernel / after it
def test_flash_attention_lowers_for_cuda(cuda_export, t, segments, tiles, hq, hkv):
    q = jax.ShapeDtypeStruct((2, t, hq, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, t, hkv, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, t), jnp.int32) if segments else None

    sinks = jax.ShapeDtypeStruct((hq,), jnp.float32) if t == 17 else None  # gpt-oss's sinks on one case

    def loss(q, k, v, seg, sinks):
        return flash_attention(q, k, v, seg, tiles=tiles, shared_prefix=segments == "shared",
                               sinks=sinks).astype(jnp.float32).sum()

    module = cuda_export(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg, sinks)
    assert module.count(f"@{CUSTOM_CALL}(") == 3  # forward, dq, dk+dv kernels


@pytest.mark.parametrize("d,segments,window", [(256, True, 1024), (512, False, None), (512, True, None)])
def test_wide_heads_lower_for_cuda(cuda_export, d, segments, window):
    """Heads of 256 and 512 at Gemma 4's shapes (bf16, seq 2048, its window on the sliding layers): the forward and
    both backward kernels lower with the wide tiles."""
    from pallas_kernels.flash_attention import WIDE_TILES, tiles_for

    assert tiles_for(d) == WIDE_TILES[d]
    q = jax.ShapeDtypeStruct((1, 2048, 16, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2048, 4, d), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 2048), jnp.int32) if segments else None

    def loss(q, k, v, seg):
        return flash_attention(q, k, v, seg, sliding_window=window).astype(jnp.float32).sum()

    module = cuda_export(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
    assert module.count(f"@{CUSTOM_CALL}(") == 3


def test_bad_tiles_fail_cuda_lowering(cuda_export):
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    with pytest.raises(Exception, match="power of 2"):
        cuda_export(lambda q: flash_attention(q, q, q, tiles=AttentionTiles(block_q=48, block_k=48)), q)


def test_a_rejected_tile_skips_the_chosen_branch():
    """Query tiles of the second response loop over the prompt's key tiles and their own, never the first
    response's (the work a shared prompt must not add back)."""
    from pallas_kernels.flash_attention import _key_loops, _query_segment_args, _skipped_key_tiles

    seg = jnp.asarray([[1] * 64 + [-2] * 64 + [-3] * 64], jnp.int32)
    _, _, start, own, pend, _ = (np.asarray(a)[0] for a in _query_segment_args(seg, True))
    tile = slice(128, 144)  # rejected queries; key tiles of 16: prompt 0-3, chosen 4-7, rejected 8-11
    gap = _skipped_key_tiles(own[tile], pend[tile], 16)
    loops = [(int(a), int(b)) for a, b in _key_loops(int(start[tile].min()) // 16, 9, gap)]
    assert loops == [(0, 4), (8, 9)]
    chosen = slice(64, 80)  # chosen queries see the prompt and themselves: one contiguous range
    gap = _skipped_key_tiles(own[chosen], pend[chosen], 16)
    visited = {t for a, b in _key_loops(int(start[chosen].min()) // 16, 5, gap) for t in range(int(a), int(b))}
    assert visited == set(range(5))
