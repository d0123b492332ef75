"""The chunked gated delta rule (Gated DeltaNet's linear attention) for GPU in Pallas (Triton), forward and backward,
and its reference.

Per value head, with a state S [dk, dv] carried in float32 and restarted at every packed segment start:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T,    o_t = S_t^T q_t / sqrt(dk)

Chunks of C = 64 tokens in the WY form. Per chunk, with gamma the log decay summed from the chunk's start, D the
decay between two tokens of one segment (D_ij = exp(gamma_i - gamma_j), j <= i), fs the factor by which a token
reads the incoming state (exp(gamma), 0 after a segment start in the chunk), te the factor by which it writes the
outgoing one (exp(gamma_last - gamma) in the chunk's last segment, else 0) and keep the carried state's
(exp(gamma_last), 0 if a segment starts in the chunk):

    A = strict_lower((diag(beta) K K^T) * D),  T = (I + A)^-1            (kernel 1, every chunk at once)
    U = T diag(beta) V,  W = T diag(beta fs) K
    V' = U - W S,  S <- keep S + (diag(te) K)^T V'                          (kernel 2, chunk after chunk)
    O = diag(fs) Q S + ((Q K^T) * D) V'                                     (kernel 3, every chunk at once)

T is a blocked inverse: 16 x 16 diagonal blocks by forward substitution, the blocks below them by products of
those (stable, unlike a Neumann series). The backward recomputes kernels 1 and 2 (nothing per chunk is kept
between the passes: the residuals are the inputs), runs the state's gradient backwards chunk after chunk (kernel
4) and every chunk's gradients at once: by key columns (kernel 5: dq, dW, the attention's part of dk), then
through the WY form (kernel 6: dv, the rest of dk, dbeta), so that no program holds more than [C, 64] tiles.
The per-token factors (gamma, fs, te, keep) are plain jnp around the kernels, so autodiff carries their gradients
to g. Grouped heads read their key head through the
index map; q and k gradients come out per value head and are summed over the group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

CHUNK = 64
SUB = 16  # rows of a diagonal block of the blocked inverse: the smallest tensor-core dot
BLOCK_V = 64  # value columns per program of the sequential kernels (the state tile is [dk, BLOCK_V] in registers)
BLOCK_K = 64  # key columns per program of the backward's first chunk kernel (its accumulators are [C, BLOCK_K])
WARPS = {"wy": 4, "states": 4, "output": 4, "state_grads": 4, "chunk_grads_qk": 4, "chunk_grads_wy": 4}
STAGES = 1


def gated_delta_reference(q, k, v, g, beta, segment_ids=None, initial_state=None):
    """float64 numpy, token by token: (o [B, T, Hv, dv], final state [B, Hv, dk, dv]). q, k [B, T, Hk, dk]; v
    [B, T, Hv, dv]; g, beta [B, T, Hv]; q is scaled by 1/sqrt(dk) here."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    rep = hv // hk
    out = np.zeros((b, t, hv, dv))
    final = np.zeros((b, hv, dk, dv))
    for r in range(b):
        for h in range(hv):
            s = np.zeros((dk, dv)) if initial_state is None else np.asarray(initial_state, np.float64)[r, h].copy()
            for i in range(t):
                if segment_ids is not None and (i == 0 and initial_state is None or
                                                i > 0 and segment_ids[r, i] != segment_ids[r, i - 1]):
                    s = np.zeros((dk, dv))
                qi, ki = q[r, i, h // rep] / np.sqrt(dk), k[r, i, h // rep]
                s = s * np.exp(g[r, i, h])
                s = s + np.outer(ki, beta[r, i, h] * (v[r, i, h] - ki @ s))
                out[r, i, h] = qi @ s
            final[r, h] = s
    return out, final


# ------------------------------------------------------------------------------------------ per-token factors


def chunk_factors(g: jax.Array, segment_ids: jax.Array | None, carried: bool, chunk: int):
    """From g [B, Tp, H] (float32, Tp whole chunks): gamma, fs, te [B, H, Tp], keep [B, H, Tp] (the chunk's factor
    at its first token, 0 elsewhere) and the running segment index [B, Tp] (int32). Plain jnp: differentiable."""
    b, tp, h = g.shape
    n = tp // chunk
    if segment_ids is None:
        restart = jnp.zeros((b, tp), bool)
    else:
        first = jnp.logical_not(jnp.full((b, 1), carried))
        restart = jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    seg = jnp.cumsum(restart.astype(jnp.int32), axis=1)
    gam = jnp.cumsum(jnp.moveaxis(g, 2, 1).reshape(b, h, n, chunk), axis=-1)  # [B, H, N, C]
    rc = restart.reshape(b, 1, n, chunk)
    reads = jnp.cumsum(rc.astype(jnp.int32), axis=-1) == 0
    fs = jnp.where(reads, jnp.exp(gam), 0.0)
    last = gam[..., -1:]
    sc = seg.reshape(b, 1, n, chunk)
    tail = sc == sc[..., -1:]
    te = jnp.where(tail, jnp.exp(jnp.where(tail, last - gam, 0.0)), 0.0)
    keep = jnp.where(jnp.any(rc, axis=-1, keepdims=True), 0.0, jnp.exp(last))
    keep = jnp.where(jnp.arange(chunk) == 0, keep, 0.0)
    flat = lambda x: x.reshape(b, h, tp)  # noqa: E731
    return flat(gam), flat(fs), flat(te), flat(keep), seg


# --------------------------------------------------------------------------------------------- the kernels


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_tn(a, b):  # a^T b
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nt(a, b):  # a b^T
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _decay(gam_i, gam_j, seg_i, seg_j, pos_i, pos_j, strict: bool):
    """D between row tokens i and column tokens j: exp(gamma_i - gamma_j) for j before i (or at it) in one segment."""
    mask = (seg_i[:, None] == seg_j[None, :]) & ((pos_i[:, None] > pos_j[None, :]) if strict
                                                 else (pos_i[:, None] >= pos_j[None, :]))
    return jnp.where(mask, jnp.exp(jnp.where(mask, gam_i[:, None] - gam_j[None, :], 0.0)), 0.0)


def _unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower [SUB, SUB] block, by forward substitution one row at a time."""
    rows = jax.lax.broadcasted_iota(jnp.int32, a.shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, a.shape, 1)
    inv = jnp.where(rows == cols, 1.0, 0.0)
    for r in range(1, a.shape[0]):
        a_r = jnp.sum(jnp.where(rows == r, a, 0.0), axis=0)  # row r of a, as a vector over columns
        inv = inv - jnp.where(rows == r, jnp.sum(a_r[:, None] * inv, axis=0)[None, :], 0.0)
    return inv


def _wy_kernel(k_ref, v_ref, beta_ref, gam_ref, fs_ref, seg_ref, u_ref, w_ref, *t_ref, chunk):
    """U, W (and T when the backward asks for it) of one chunk of one value head."""
    n_sub = chunk // SUB
    subs = [pl.ds(i * SUB, SUB) for i in range(n_sub)]
    k = [k_ref[s, :] for s in subs]
    beta = [beta_ref[s] for s in subs]
    gam = [gam_ref[s] for s in subs]
    seg = [seg_ref[s] for s in subs]
    pos = [i * SUB + jax.lax.iota(jnp.int32, SUB) for i in range(n_sub)]
    a = {}
    for i in range(n_sub):
        for j in range(i + 1):
            d = _decay(gam[i], gam[j], seg[i], seg[j], pos[i], pos[j], strict=True)
            a[i, j] = beta[i][:, None] * _dot_nt(k[i], k[j]) * d
    t = {}
    for i in range(n_sub):
        t[i, i] = _unit_lower_inverse(a[i, i])
        for j in range(i - 1, -1, -1):
            acc = _dot(a[i, j], t[j, j])
            for m in range(j + 1, i):
                acc = acc + _dot(a[i, m], t[m, j])
            t[i, j] = -_dot(t[i, i], acc)
    xw = [(beta[j] * fs_ref[subs[j]])[:, None] * k[j].astype(jnp.float32) for j in range(n_sub)]
    xu = [beta[j][:, None] * v_ref[subs[j], :].astype(jnp.float32) for j in range(n_sub)]
    for i in range(n_sub):
        u = sum(_dot(t[i, j], xu[j]) for j in range(i + 1))
        w = sum(_dot(t[i, j], xw[j]) for j in range(i + 1))
        u_ref[subs[i], :] = u.astype(u_ref.dtype)
        w_ref[subs[i], :] = w.astype(w_ref.dtype)
        if t_ref:
            for j in range(n_sub):
                t_ref[0][subs[i], subs[j]] = t[i, j] if j <= i else jnp.zeros((SUB, SUB), jnp.float32)


def _state_kernel(w_ref, u_ref, k_ref, te_ref, keep_ref, s0_ref, vn_ref, states_ref, final_ref, *, chunk, n):
    """The state pass of one value head's BLOCK_V columns: every chunk's incoming state and its new values V'."""
    def body(c, s):
        rows = pl.ds(c * chunk, chunk)
        states_ref[c, :, :] = s
        w = w_ref[rows, :]
        vn = u_ref[rows, :].astype(jnp.float32) - _dot(w, s.astype(w.dtype))
        vn_ref[rows, :] = vn.astype(vn_ref.dtype)
        k_end = (te_ref[rows][:, None] * k_ref[rows, :].astype(jnp.float32)).astype(w.dtype)
        keep = jnp.sum(keep_ref[rows])
        return keep * s + _dot_tn(k_end, vn.astype(w.dtype))

    final_ref[...] = jax.lax.fori_loop(0, n, body, s0_ref[...].astype(jnp.float32))


def _output_kernel(q_ref, k_ref, vn_ref, states_ref, gam_ref, fs_ref, seg_ref, o_ref, *, chunk):
    """O of one chunk of one value head, BLOCK_V columns."""
    q, k = q_ref[...], k_ref[...]
    gam, seg = gam_ref[...], seg_ref[...]
    pos = jax.lax.iota(jnp.int32, chunk)
    attn = _dot_nt(q, k) * _decay(gam, gam, seg, seg, pos, pos, strict=False)
    vn = vn_ref[...]
    s = states_ref[...]
    o = fs_ref[...][:, None] * _dot(q, s.astype(q.dtype)) + _dot(attn.astype(vn.dtype), vn)
    o_ref[...] = o.astype(o_ref.dtype)


def _state_grad_kernel(q_ref, k_ref, w_ref, do_ref, gam_ref, fs_ref, te_ref, keep_ref, seg_ref, dfinal_ref,
                       dvn_ref, dafter_ref, ds0_ref, *, chunk, n):
    """Backwards chunk after chunk, for BLOCK_V columns: dV' of every chunk and the state's gradient after it."""
    pos = jax.lax.iota(jnp.int32, chunk)

    def body(i, ds):
        c = n - 1 - i
        rows = pl.ds(c * chunk, chunk)
        dafter_ref[c, :, :] = ds
        q, k, w = q_ref[rows, :], k_ref[rows, :], w_ref[rows, :]
        gam, seg = gam_ref[rows], seg_ref[rows]
        attn = _dot_nt(q, k) * _decay(gam, gam, seg, seg, pos, pos, strict=False)
        do = do_ref[rows, :]
        k_end = (te_ref[rows][:, None] * k.astype(jnp.float32)).astype(w.dtype)
        dvn = _dot_tn(attn.astype(do.dtype), do) + _dot(k_end, ds.astype(w.dtype))
        dvn_ref[rows, :] = dvn.astype(dvn_ref.dtype)
        q_read = (fs_ref[rows][:, None] * q.astype(jnp.float32)).astype(do.dtype)
        keep = jnp.sum(keep_ref[rows])
        return keep * ds + _dot_tn(q_read, do) - _dot_tn(w, dvn.astype(w.dtype))

    ds0_ref[...] = jax.lax.fori_loop(0, n, body, dfinal_ref[...].astype(jnp.float32))


def _chunk_grad_qk_kernel(q_ref, k_ref, vn_ref, dvn_ref, do_ref, states_ref, dafter_ref, gam_ref, fs_ref, te_ref,
                          seg_ref, dq_ref, dk_ref, dw_ref, dfs_ref, dte_ref, dkeep_ref, dgam_ref, *, chunk, dv,
                          block_v):
    """One chunk of one value head, BLOCK_K key columns: dq, the attention's and the outgoing state's part of dk,
    dW, and those columns' shares of the per-token factors' gradients (summed over the key blocks after)."""
    f32, lo = jnp.float32, q_ref.dtype  # dots read their operands in the inputs' dtype, accumulate in float32
    mm, mm_tn, mm_nt = (lambda a, b, f=f: f(a.astype(lo), b.astype(lo)) for f in (_dot, _dot_tn, _dot_nt))
    q, k = q_ref[...], k_ref[...]
    gam, fs, te, seg = gam_ref[...], fs_ref[...], te_ref[...], seg_ref[...]
    pos = jax.lax.iota(jnp.int32, chunk)
    d = _decay(gam, gam, seg, seg, pos, pos, strict=False)
    dq = jnp.zeros(q.shape, f32)
    dw = jnp.zeros(k.shape, f32)
    k_rows = jnp.zeros(k.shape, f32)  # V' dS_after^T: the outgoing state's gradient by key
    dov = jnp.zeros((chunk, chunk), f32)
    dfs = jnp.zeros((chunk,), f32)
    dkeep = jnp.zeros((), f32)
    for c in range(dv // block_v):
        cols = pl.ds(c * block_v, block_v)
        s, da = states_ref[:, cols], dafter_ref[:, cols]
        vn, dvn, do = vn_ref[:, cols], dvn_ref[:, cols], do_ref[:, cols]
        dq = dq + mm_nt(do, s)
        dov = dov + mm_nt(do, vn)
        k_rows = k_rows + mm_nt(vn, da)
        dw = dw - mm_nt(dvn, s)
        dkeep = dkeep + jnp.sum(s * da)
    q32, k32 = q.astype(f32), k.astype(f32)
    dfs = jnp.sum(q32 * dq, axis=1)
    dattn = dov * d
    dq_ref[...] = fs[:, None] * dq + mm(dattn, k)
    dk_ref[...] = mm_tn(dattn, q) + te[:, None] * k_rows
    dw_ref[...] = dw
    e = dov * mm_nt(q, k) * d
    dfs_ref[...] = dfs
    dte_ref[...] = jnp.sum(k32 * k_rows, axis=1)
    dkeep_ref[...] = jnp.where(pos == 0, dkeep, 0.0)
    dgam_ref[...] = jnp.sum(e, axis=1) - jnp.sum(e, axis=0)


def _chunk_grad_wy_kernel(k_ref, v_ref, dvn_ref, dw_ref, t_ref, beta_ref, gam_ref, fs_ref, seg_ref, dk_ref, dv_ref,
                          dbeta_ref, dfs_ref, dgam_ref, *, chunk, dk, dv, block_k, block_v):
    """One chunk of one value head: the gradients through the WY form (U = T diag(beta) V, W = T diag(beta fs) K,
    T = (I + A)^-1): dv, the rest of dk, dbeta, and the WY form's share of dfs and dgamma."""
    f32, lo = jnp.float32, k_ref.dtype
    mm, mm_tn, mm_nt = (lambda a, b, f=f: f(a.astype(lo), b.astype(lo)) for f in (_dot, _dot_tn, _dot_nt))
    beta, gam, fs, seg = beta_ref[...], gam_ref[...], fs_ref[...], seg_ref[...]
    bf = beta * fs
    t = t_ref[...]
    pos = jax.lax.iota(jnp.int32, chunk)
    d = _decay(gam, gam, seg, seg, pos, pos, strict=False)
    strict = pos[:, None] > pos[None, :]
    dt = jnp.zeros((chunk, chunk), f32)
    kk = jnp.zeros((chunk, chunk), f32)
    dbeta = jnp.zeros((chunk,), f32)
    for c in range(dv // block_v):
        cols = pl.ds(c * block_v, block_v)
        v, dvn = v_ref[:, cols].astype(f32), dvn_ref[:, cols].astype(f32)
        dt = dt + _dot_nt(dvn, beta[:, None] * v)
        dxu = _dot_tn(t, dvn)
        dv_ref[:, cols] = (beta[:, None] * dxu).astype(dv_ref.dtype)
        dbeta = dbeta + jnp.sum(v * dxu, axis=1)
    for c in range(dk // block_k):
        cols = pl.ds(c * block_k, block_k)
        k = k_ref[:, cols]
        dt = dt + _dot_nt(dw_ref[:, cols], bf[:, None] * k.astype(f32))
        kk = kk + mm_nt(k, k)
    da = jnp.where(strict, -_dot_nt(_dot_tn(t, dt), t), 0.0)
    gm = da * d
    dbeta = dbeta + jnp.sum(gm * kk, axis=1)
    dfs = jnp.zeros((chunk,), f32)
    for c in range(dk // block_k):
        cols = pl.ds(c * block_k, block_k)
        k = k_ref[:, cols].astype(f32)
        dxw = _dot_tn(t, dw_ref[:, cols])
        kdxw = jnp.sum(k * dxw, axis=1)
        dbeta = dbeta + fs * kdxw
        dfs = dfs + beta * kdxw
        dk_ref[:, cols] = bf[:, None] * dxw + beta[:, None] * mm(gm, k) + mm_tn(gm, beta[:, None] * k)
    e = da * beta[:, None] * kk * d
    dbeta_ref[...] = dbeta
    dfs_ref[...] = dfs
    dgam_ref[...] = jnp.sum(e, axis=1) - jnp.sum(e, axis=0)


# ------------------------------------------------------------------------------------------------ launches


def _params(kernel: str) -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=WARPS[kernel], num_stages=STAGES)


def _token_spec(c, d, head):
    """A [C, d] chunk of a [B, Tp, H, d] array; `head` maps the value head to the array's head."""
    return pl.BlockSpec((None, c, None, d), lambda n, b, h: (b, n, head(h), 0))


def _vector_spec(c):
    return pl.BlockSpec((None, None, c), lambda n, b, h: (b, h, n))


def _seg_spec(c):
    return pl.BlockSpec((None, c), lambda n, b, h: (b, n))


def _wy(k, v, beta, gam, fs, seg, group, chunk, with_t, interpret):
    b, tp, hv, dv = v.shape
    dk = k.shape[-1]
    n = tp // chunk
    out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((b, tp, hv, dk), k.dtype)]
    out_specs = [_token_spec(chunk, dv, lambda h: h), _token_spec(chunk, dk, lambda h: h)]
    if with_t:
        out_shape.append(jax.ShapeDtypeStruct((b, hv, tp, chunk), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, chunk, chunk), lambda n, b, h: (b, h, n, 0)))
    return pl.pallas_call(
        functools.partial(_wy_kernel, chunk=chunk),
        grid=(n, b, hv),
        in_specs=[_token_spec(chunk, dk, lambda h: h // group), _token_spec(chunk, dv, lambda h: h),
                  _vector_spec(chunk), _vector_spec(chunk), _vector_spec(chunk), _seg_spec(chunk)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params("wy"),
        interpret=interpret,
        name="gated_delta_wy",
    )(k, v, beta, gam, fs, seg)


def _sequence_spec(tp, d, head):
    """A head's whole sequence [Tp, d] of a [B, Tp, H, d] array, for the kernels that walk the chunks."""
    return pl.BlockSpec((None, tp, None, d), lambda b, h, c: (b, 0, head(h), 0))


def _sequence_cols_spec(tp, bv):
    return pl.BlockSpec((None, tp, None, bv), lambda b, h, c: (b, 0, h, c))


def _sequence_vector_spec(tp):
    return pl.BlockSpec((None, None, tp), lambda b, h, c: (b, h, 0))


def _state_tile_spec(dk, bv):
    return pl.BlockSpec((None, None, dk, bv), lambda b, h, c: (b, h, 0, c))


def _states_spec(n, dk, bv):
    return pl.BlockSpec((None, None, n, dk, bv), lambda b, h, c: (b, h, 0, 0, c))


def _state_pass(w, u, k, te, keep, s0, group, chunk, interpret):
    b, tp, hv, dv = u.shape
    dk = w.shape[-1]
    n, bv = tp // chunk, min(BLOCK_V, dv)
    return pl.pallas_call(
        functools.partial(_state_kernel, chunk=chunk, n=n),
        grid=(b, hv, dv // bv),
        in_specs=[_sequence_spec(tp, dk, lambda h: h), _sequence_cols_spec(tp, bv),
                  _sequence_spec(tp, dk, lambda h: h // group), _sequence_vector_spec(tp),
                  _sequence_vector_spec(tp), _state_tile_spec(dk, bv)],
        out_specs=[_sequence_cols_spec(tp, bv), _states_spec(n, dk, bv), _state_tile_spec(dk, bv)],
        out_shape=[jax.ShapeDtypeStruct(u.shape, u.dtype),
                   jax.ShapeDtypeStruct((b, hv, n, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32)],
        compiler_params=_params("states"),
        interpret=interpret,
        name="gated_delta_states",
    )(w, u, k, te, keep, s0)


def _output(q, k, vn, states, gam, fs, seg, group, chunk, out_dtype, interpret):
    b, tp, hv, dv = vn.shape
    dk = q.shape[-1]
    n, bv = tp // chunk, min(BLOCK_V, dv)
    head = lambda h: h // group  # noqa: E731
    return pl.pallas_call(
        functools.partial(_output_kernel, chunk=chunk),
        grid=(n, b, hv, dv // bv),
        in_specs=[pl.BlockSpec((None, chunk, None, dk), lambda n, b, h, c: (b, n, head(h), 0)),
                  pl.BlockSpec((None, chunk, None, dk), lambda n, b, h, c: (b, n, head(h), 0)),
                  pl.BlockSpec((None, chunk, None, bv), lambda n, b, h, c: (b, n, h, c)),
                  pl.BlockSpec((None, None, None, dk, bv), lambda n, b, h, c: (b, h, n, 0, c)),
                  pl.BlockSpec((None, None, chunk), lambda n, b, h, c: (b, h, n)),
                  pl.BlockSpec((None, None, chunk), lambda n, b, h, c: (b, h, n)),
                  pl.BlockSpec((None, chunk), lambda n, b, h, c: (b, n))],
        out_specs=pl.BlockSpec((None, chunk, None, bv), lambda n, b, h, c: (b, n, h, c)),
        out_shape=jax.ShapeDtypeStruct(vn.shape, out_dtype),
        compiler_params=_params("output"),
        interpret=interpret,
        name="gated_delta_output",
    )(q, k, vn, states, gam, fs, seg)


def _forward(q, k, v, beta, gam, fs, te, keep, seg, s0, chunk, interpret, with_t=False):
    group = v.shape[2] // k.shape[2]
    u, w, *t = _wy(k, v, beta, gam, fs, seg, group, chunk, with_t, interpret)
    vn, states, final = _state_pass(w, u, k, te, keep, s0, group, chunk, interpret)
    return u, w, t, vn, states, final


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _chunked(q, k, v, beta, gam, fs, te, keep, seg, s0, chunk, interpret):
    group = v.shape[2] // k.shape[2]
    _, _, _, vn, states, final = _forward(q, k, v, beta, gam, fs, te, keep, seg, s0, chunk, interpret)
    return _output(q, k, vn, states, gam, fs, seg, group, chunk, v.dtype, interpret), final


def _chunked_fwd(q, k, v, beta, gam, fs, te, keep, seg, s0, chunk, interpret):
    out = _chunked(q, k, v, beta, gam, fs, te, keep, seg, s0, chunk, interpret)
    return out, (q, k, v, beta, gam, fs, te, keep, seg, s0)


def _state_grads(q, k, w, do, gam, fs, te, keep, seg, dfinal, group, chunk, interpret):
    b, tp, hv, dv = do.shape
    dk = k.shape[-1]
    n, bv = tp // chunk, min(BLOCK_V, dv)
    return pl.pallas_call(
        functools.partial(_state_grad_kernel, chunk=chunk, n=n),
        grid=(b, hv, dv // bv),
        in_specs=[_sequence_spec(tp, dk, lambda h: h // group), _sequence_spec(tp, dk, lambda h: h // group),
                  _sequence_spec(tp, dk, lambda h: h), _sequence_cols_spec(tp, bv)]
                 + [_sequence_vector_spec(tp)] * 4
                 + [pl.BlockSpec((None, tp), lambda b, h, c: (b, 0)), _state_tile_spec(dk, bv)],
        out_specs=[_sequence_cols_spec(tp, bv), _states_spec(n, dk, bv), _state_tile_spec(dk, bv)],
        out_shape=[jax.ShapeDtypeStruct(do.shape, jnp.float32),
                   jax.ShapeDtypeStruct((b, hv, n, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32)],
        compiler_params=_params("state_grads"),
        interpret=interpret,
        name="gated_delta_state_grads",
    )(q, k, w, do, gam, fs, te, keep, seg, dfinal.astype(jnp.float32))


def _chunk_grads(q, k, v, vn, dvn, do, states, dafter, t, beta, gam, fs, te, seg, group, chunk, interpret):
    """Every gradient of every chunk at once, in two kernels: by key columns (dq, dW, dk's attention part), then
    through the WY form (dv, dk's rest, dbeta). Returns dq, dk [B, Tp, Hv, dk], dv, dbeta, dgamma, dfs, dte, dkeep."""
    b, tp, hv, dv = v.shape
    dk = k.shape[-1]
    n, bv, bk = tp // chunk, min(BLOCK_V, dv), min(BLOCK_K, dk)
    nk = dk // bk
    head = lambda h: h // group  # noqa: E731
    key_cols = pl.BlockSpec((None, chunk, None, bk), lambda n, b, h, c: (b, n, head(h), c))
    value_cols = pl.BlockSpec((None, chunk, None, bk), lambda n, b, h, c: (b, n, h, c))
    whole = pl.BlockSpec((None, chunk, None, dv), lambda n, b, h, c: (b, n, h, 0))
    state_rows = pl.BlockSpec((None, None, None, bk, dv), lambda n, b, h, c: (b, h, n, c, 0))
    vector = pl.BlockSpec((None, None, chunk), lambda n, b, h, c: (b, h, n))
    partial = pl.BlockSpec((None, None, None, chunk), lambda n, b, h, c: (c, b, h, n))
    partial_shape = jax.ShapeDtypeStruct((nk, b, hv, tp), jnp.float32)
    dq, dk_a, dw, dfs_a, dte, dkeep, dgam_a = pl.pallas_call(
        functools.partial(_chunk_grad_qk_kernel, chunk=chunk, dv=dv, block_v=bv),
        grid=(n, b, hv, nk),
        in_specs=[key_cols, key_cols, whole, whole, whole, state_rows, state_rows, vector, vector, vector,
                  pl.BlockSpec((None, chunk), lambda n, b, h, c: (b, n))],
        out_specs=[value_cols] * 3 + [partial] * 4,
        out_shape=[jax.ShapeDtypeStruct((b, tp, hv, dk), jnp.float32)] * 3 + [partial_shape] * 4,
        compiler_params=_params("chunk_grads_qk"),
        interpret=interpret,
        name="gated_delta_chunk_grads_qk",
    )(q, k, vn, dvn, do, states, dafter, gam, fs, te, seg)
    vector = jax.ShapeDtypeStruct((b, hv, tp), jnp.float32)
    dk_b, dv_, dbeta, dfs_b, dgam_b = pl.pallas_call(
        functools.partial(_chunk_grad_wy_kernel, chunk=chunk, dk=dk, dv=dv, block_k=bk, block_v=bv),
        grid=(n, b, hv),
        in_specs=[_token_spec(chunk, dk, head), _token_spec(chunk, dv, lambda h: h),
                  _token_spec(chunk, dv, lambda h: h), _token_spec(chunk, dk, lambda h: h),
                  pl.BlockSpec((None, None, chunk, chunk), lambda n, b, h: (b, h, n, 0))]
                 + [_vector_spec(chunk)] * 3 + [_seg_spec(chunk)],
        out_specs=[_token_spec(chunk, dk, lambda h: h), _token_spec(chunk, dv, lambda h: h)]
                  + [_vector_spec(chunk)] * 3,
        out_shape=[jax.ShapeDtypeStruct((b, tp, hv, dk), jnp.float32), jax.ShapeDtypeStruct(v.shape, jnp.float32)]
                  + [vector] * 3,
        compiler_params=_params("chunk_grads_wy"),
        interpret=interpret,
        name="gated_delta_chunk_grads_wy",
    )(k, v, dvn, dw, t, beta, gam, fs, seg)
    return (dq, dk_a + dk_b, dv_, dbeta, dgam_a.sum(0) + dgam_b, dfs_a.sum(0) + dfs_b, dte.sum(0),
            dkeep.sum(0))


def _chunked_bwd(chunk, interpret, residuals, grads):
    q, k, v, beta, gam, fs, te, keep, seg, s0 = residuals
    do, dfinal = grads
    b, tp, hv, _ = v.shape
    hk, dk = k.shape[2:]
    group = hv // hk
    _, w, [t], vn, states, _ = _forward(q, k, v, beta, gam, fs, te, keep, seg, s0, chunk, interpret, with_t=True)
    do = do.astype(v.dtype)
    dvn, dafter, ds0 = _state_grads(q, k, w, do, gam, fs, te, keep, seg, dfinal, group, chunk, interpret)
    dq, dk_, dv_, dbeta, dgam, dfs, dte, dkeep = _chunk_grads(q, k, v, vn, dvn, do, states, dafter, t, beta, gam,
                                                              fs, te, seg, group, chunk, interpret)
    per_key_head = lambda x: x.reshape(b, tp, hk, group, dk).sum(3)  # noqa: E731
    return (per_key_head(dq).astype(q.dtype), per_key_head(dk_).astype(k.dtype), dv_.astype(v.dtype), dbeta,
            dgam, dfs, dte, dkeep, None, ds0.astype(s0.dtype))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def gated_delta_rule_pallas(q, k, v, g, beta, *, segment_ids=None, initial_state=None, chunk: int = CHUNK,
                            interpret: bool = False):
    """(o [B, T, Hv, dv] in v's dtype, final state [B, Hv, dk, dv] float32), differentiable in every input. q, k
    [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv] (float32); dk and dv powers of two >= 16. q, k and v
    are read in their own dtype (bf16 for speed; float32 dots are TF32 on the GPU)."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    if hv % hk or dk < SUB or dv < SUB or dk & (dk - 1) or dv & (dv - 1) or chunk % SUB:
        raise ValueError(f"gated delta kernel: key heads {hk} must divide value heads {hv}, head dims {dk}, {dv} "
                         f"must be powers of two >= {SUB}, chunk {chunk} a multiple of {SUB}")
    pad = -t % chunk
    q = (q * dk ** -0.5).astype(q.dtype)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        g, beta = (jnp.pad(x, widths[:3]) for x in (g, beta))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), mode="edge")
    gam, fs, te, keep, seg = chunk_factors(g.astype(jnp.float32), segment_ids, initial_state is not None, chunk)
    beta_t = jnp.moveaxis(beta.astype(jnp.float32), 2, 1)
    s0 = jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    out, final = _chunked(q, k, v, beta_t, gam, fs, te, keep, seg, s0, chunk, interpret)
    return out[:, :t], final
