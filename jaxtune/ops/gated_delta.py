"""The gated delta rule (Gated DeltaNet's linear attention), token by token and in chunks, in XLA.

Per head, with a state S [dk, dv] that starts at zero (or `initial_state`) and restarts at every segment start:

    S_t = exp(g_t) S_{t-1};  S_t = S_t + k_t (beta_t (v_t - k_t^T S_t))^T;  o_t = S_t^T q_t / sqrt(dk)

(q and k L2-normalised by the caller's choice, g_t <= 0 the log decay, beta_t in (0, 1) the step). The chunked form
computes C tokens at a time with the WY representation: within a chunk the delta rule's corrections are one
unit-lower-triangular solve, and only the state crosses chunks (a `jax.lax.scan` carrying S in float32), so the
work is matmuls of [C, C] and [C, d]. Packed rows (segment ids) cut every interaction across a segment start:
within a chunk by a same-segment mask, across chunks by reading and carrying the state only inside one segment.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 64


def _prepare(q, k, v, g, beta):
    """[B, T, H, d] inputs in float32, grouped q/k heads repeated to the value heads, q scaled by 1/sqrt(dk)."""
    hk, hv = q.shape[2], v.shape[2]
    if hv != hk:
        q, k = (jnp.repeat(x, hv // hk, axis=2) for x in (q, k))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    q, k, v, g, beta = map(f32, (q, k, v, g, beta))
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _starts(segment_ids: jax.Array | None, shape: tuple[int, int]) -> jax.Array:
    """[B, T] True where a segment starts (the state restarts there); all False but padding edges without ids."""
    if segment_ids is None:
        return jnp.zeros(shape, bool)
    first = jnp.ones_like(segment_ids[:, :1], bool)
    return jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def gated_delta_rule_recurrent(q, k, v, g, beta, *, segment_ids=None, initial_state=None):
    """(o [B, T, Hv, dv] in q's dtype, final state [B, Hv, dk, dv] float32), one token at a time (decode steps, and
    the reference the chunked form is checked against). q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    if segment_ids is not None:
        restart = _starts(segment_ids, (b, t))
        if initial_state is not None:  # a given state carries into the first token's segment
            restart = restart.at[:, 0].set(False)
    else:
        restart = jnp.zeros((b, t), bool)

    def step(s, xs):
        qt, kt, vt, gt, bt, rt = xs
        s = jnp.where(rt[:, None, None, None], 0.0, s) * jnp.exp(gt)[..., None, None]
        kv = jnp.einsum("bhkv,bhk->bhv", s, kt)
        delta = (vt - kv) * bt[..., None]
        s = s + kt[..., :, None] * delta[..., None, :]
        return s, jnp.einsum("bhkv,bhk->bhv", s, qt)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, restart))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1).astype(out_dtype), state


def gated_delta_rule_chunked(q, k, v, g, beta, *, segment_ids=None, initial_state=None, chunk: int = CHUNK,
                             state_pass: str = "scan"):
    """The same as `gated_delta_rule_recurrent`, `chunk` tokens at a time (training and prefill). `state_pass`:
    "scan" carries the state chunk after chunk; "associative" composes the chunks' affine state maps by a parallel
    prefix (more FLOPs, log2 of the chunks in depth)."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    pad = -t % chunk
    restart = _starts(segment_ids, (b, t))
    if initial_state is not None:
        restart = restart.at[:, 0].set(False)
    seg = jnp.cumsum(restart.astype(jnp.int32), axis=1)  # a running segment index per row
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        g, beta = (jnp.pad(x, widths[:3]) for x in (g, beta))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
        restart = jnp.pad(restart, ((0, 0), (0, pad)))
    n = (t + pad) // chunk

    def chunks(x):  # [B, T, H, ...] -> [N, B, H, C, ...]
        x = x.reshape(b, n, chunk, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 3, 2) if x.ndim == 5 else jnp.moveaxis(x, 1, 0).swapaxes(2, 3)

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))  # [N, B, H, C, d] and [N, B, H, C]
    sc = jnp.moveaxis(seg.reshape(b, n, chunk), 1, 0)  # [N, B, C]
    rc = jnp.moveaxis(restart.reshape(b, n, chunk), 1, 0)
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    eye = jnp.eye(chunk, dtype=jnp.float32)
    state = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    # everything that does not read the state, for every chunk at once (batched matmuls and solves); the scan
    # below carries the state only
    cum = jnp.cumsum(gc, axis=-1)  # [N, B, H, C]
    same = (sc[..., :, None] == sc[..., None, :]) & lower  # [N, B, C, C]: j <= i within one segment
    decay = jnp.where(same[:, :, None], jnp.exp(jnp.where(same[:, :, None], cum[..., :, None] - cum[..., None, :],
                                                          0.0)), 0.0)
    # tokens that still see the carried state: no segment start in the chunk up to them
    reads = (jnp.cumsum(rc.astype(jnp.int32), axis=-1) == 0)[:, :, None, :]  # [N, B, 1, C]
    from_state = jnp.where(reads, jnp.exp(cum), 0.0)  # [N, B, H, C]
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    system = eye + jnp.einsum("nbhik,nbhjk->nbhij", kb, kc) * (decay * (1.0 - eye))  # (I + strictly-lower A)
    solved = jax.scipy.linalg.solve_triangular(system, jnp.concatenate([vb, kb * from_state[..., None]], axis=-1),
                                               lower=True, unit_diagonal=True)
    u, w = solved[..., :dv], solved[..., dv:]  # new values, and the decayed keys that read the state
    attn = jnp.einsum("nbhik,nbhjk->nbhij", qc, kc) * decay
    q_state = qc * from_state[..., None]
    # the state after a chunk: the last token's segment only
    last = cum[..., -1:]
    tail = (sc == sc[..., -1:])[:, :, None, :]  # [N, B, 1, C]
    k_end = kc * jnp.where(tail, jnp.exp(jnp.where(tail, last - cum, 0.0)), 0.0)[..., None]
    keep = jnp.where(jnp.any(rc, axis=-1)[:, :, None, None, None], 0.0, jnp.exp(last)[..., None])  # [N, B, H, 1, 1]

    if state_pass == "scan":
        def one_chunk(s, xs):
            u, w, attn, q_state, k_end, keep = xs
            v_new = u - jnp.einsum("bhik,bhkv->bhiv", w, s)
            out = jnp.einsum("bhik,bhkv->bhiv", q_state, s) + jnp.einsum("bhij,bhjv->bhiv", attn, v_new)
            return s * keep + jnp.einsum("bhik,bhiv->bhkv", k_end, v_new), out

        state, out = jax.lax.scan(one_chunk, state, (u, w, attn, q_state, k_end, keep))  # out [N, B, H, C, dv]
    else:
        # the state after chunk c is affine in the state before it: S' = A_c S + B_c with A_c = keep_c I - K_c^T W_c
        # and B_c = K_c^T U_c ([dk, dk] and [dk, dv]), so a parallel prefix over the chunks (log2 N levels of
        # batched matmuls) gives every chunk's incoming state at once
        eye_k = jnp.eye(dk, dtype=jnp.float32)
        a = keep * eye_k - jnp.einsum("nbhik,nbhil->nbhkl", k_end, w)
        bias = jnp.einsum("nbhik,nbhiv->nbhkv", k_end, u)

        def combine(first, second):
            (a1, b1), (a2, b2) = first, second
            return jnp.einsum("...kl,...lm->...km", a2, a1), jnp.einsum("...kl,...lv->...kv", a2, b1) + b2

        prefix_a, prefix_b = jax.lax.associative_scan(combine, (a, bias))  # the state after each chunk, from S_0
        after = jnp.einsum("nbhkl,bhlv->nbhkv", prefix_a, state) + prefix_b
        before = jnp.concatenate([state[None], after[:-1]], axis=0)  # each chunk's incoming state
        v_new = u - jnp.einsum("nbhik,nbhkv->nbhiv", w, before)
        out = jnp.einsum("nbhik,nbhkv->nbhiv", q_state, before) + jnp.einsum("nbhij,nbhjv->nbhiv", attn, v_new)
        state = after[-1]
    out = jnp.moveaxis(out, 0, 1).swapaxes(2, 3).reshape(b, n * chunk, h, dv)[:, :t]
    return out.astype(out_dtype), state
