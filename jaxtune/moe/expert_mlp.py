"""The routed experts' MLP (gather → gate/up → activation → down → weighted sum per token) with its own VJP,
which saves the minimum and recomputes no frozen GEMM.

Autodiff of the plain composition keeps (or, under remat, recomputes) every grouped GEMM's input and output:
the routed rows [rows, hidden] (a gigabyte per layer at Qwen3-30B-A3B's batch 16) and the down projection's
output, and under remat "selective" its backward ran gate, up and down forward again: a third more expert-GEMM
FLOPs than the step needs (benchmarks/results/2026-11-28-moe-vs-unsloth-h200.md). Here the forward saves the
un-routed tokens [tokens, hidden], the routing, and the gate/up outputs of each routed row (named
`EXPERT_GATE_UP` for the remat policies). The backward:
- gathers the output's cotangent to the routed rows unweighted (dr) and runs down's input gradient on it once:
  g = dr @ W_down_eff, so dh = w · g and the routing weight's gradient is <h, g> per row (the down output itself
  is never needed again);
- rebuilds h = act(gate, up) from the saved outputs, takes the activation's VJP elementwise;
- re-gathers the routed rows from the saved tokens for the LoRA factors' gradients (rank r, cheap) and runs the
  gate/up input gradients.
So the frozen expert GEMMs run three times forward and three times backward, as with no remat at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxtune.moe.grouped import gathered_matmul, grouped_matmul, grouped_matmul_input_grad
from jaxtune.moe.layout import TileLayout, row_tokens

EXPERT_GATE_UP = "expert_gate_up"  # the saved gate/up outputs of the routed rows
EXPERT_ROUTING = "expert_routing"  # the saved routing: weights and the padded layout


class ExpertProjection(NamedTuple):
    """One projection of every expert: the frozen weight [E, out, in] in the compute dtype (under FP8 experts
    `fp8_expert_weights`' (wq, w_scale, wtq, wt_scale) instead), its frozen bias [E, out] (gpt-oss) or None, and the
    LoRA factors A [E, r, in], B [E, out, r] (compute dtype) or None."""
    weight: jax.Array | tuple
    bias: jax.Array | None = None
    lora_a: jax.Array | None = None
    lora_b: jax.Array | None = None


@dataclass(frozen=True)
class ExpertMLPSpec:
    """What the program depends on but the arrays do not say."""
    top_k: int
    rows: int  # the padded layout's row count
    block_m: int
    activation: str = "swiglu"  # or "clamped_swiglu" (gpt-oss), "geglu" (Gemma 4)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    scales: tuple[float, float, float] = (1.0, 1.0, 1.0)  # LoRA scale of gate, up, down
    dropouts: tuple[float, float, float] = (0.0, 0.0, 0.0)  # LoRA dropout of gate, up, down
    fp8: str | None = None  # the frozen GEMMs in e4m3 by this implementation (`dispatch.moe_fp8_impl`), or None


def activate(gate: jax.Array, up: jax.Array, spec: ExpertMLPSpec) -> jax.Array:
    """SwiGLU (silu(gate) * up), Gemma 4's GeGLU (tanh-approximated gelu(gate) * up) or gpt-oss's clamped SwiGLU,
    in the inputs' dtype."""
    if spec.activation == "geglu":
        return jax.nn.gelu(gate, approximate=True) * up
    if spec.activation == "clamped_swiglu":
        g = jnp.minimum(gate.astype(jnp.float32), spec.swiglu_limit)
        u = jnp.clip(up.astype(jnp.float32), -spec.swiglu_limit, spec.swiglu_limit)
        return ((u + 1.0) * g * jax.nn.sigmoid(spec.swiglu_alpha * g)).astype(gate.dtype)
    return jax.nn.silu(gate) * up


def _layout(position, tile_group, group_sizes, spec: ExpertMLPSpec) -> TileLayout:
    return TileLayout(position, tile_group, group_sizes, spec.rows, spec.block_m)


def _to_rows(per_copy: jax.Array, layout: TileLayout) -> jax.Array:
    """[tokens * k, ...] in token-major order → the padded rows [rows, ...] (padding zeros)."""
    out = jnp.zeros((layout.rows, *per_copy.shape[1:]), per_copy.dtype)
    return out.at[layout.position].set(per_copy, unique_indices=True)


def _gather_tokens(x: jax.Array, layout: TileLayout, top_k: int) -> jax.Array:
    """Each token's k copies [tokens, hidden] → the padded rows [rows, hidden]."""
    copies = jnp.broadcast_to(x[:, None, :], (x.shape[0], top_k, x.shape[1])).reshape(-1, x.shape[1])
    return _to_rows(copies, layout)


def add_expert_bias(y: jax.Array, bias: jax.Array | None, layout: TileLayout) -> jax.Array:
    """y [rows, out] plus each row's expert's bias (padding rows get some expert's; they are never read back)."""
    if bias is None:
        return y
    per_tile = jnp.take(bias, jnp.maximum(layout.tile_group, 0), axis=0).astype(jnp.float32)  # [tiles, out]
    tiles = y.shape[0] // layout.block_m
    out = y.reshape(tiles, layout.block_m, -1).astype(jnp.float32) + per_tile[:, None, :]
    return out.reshape(y.shape).astype(y.dtype)


def _lora(x: jax.Array, a: jax.Array, b: jax.Array, layout: TileLayout, scale: float, dropout: float,
          key: jax.Array | None) -> jax.Array:
    """scale * (dropout(x) @ A[e]ᵀ) @ B[e]ᵀ per row's expert (the same key in forward and backward: the same
    mask)."""
    hidden = grouped_matmul(_dropped(x, dropout, key), a, layout, trainable=True) * jnp.asarray(scale, x.dtype)
    return grouped_matmul(hidden, b, layout, trainable=True)


def _dropped(x: jax.Array, dropout: float, key: jax.Array | None) -> jax.Array:
    """LoRA's input dropout (the mask drawn from `key`: the same in forward and backward)."""
    if key is None or dropout <= 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - dropout, x.shape)
    return jnp.where(keep, x / (1.0 - dropout), 0).astype(x.dtype)


def _fp8_tiles(layout: TileLayout):
    from pallas_kernels.grouped_fp8_matmul import GroupedFp8Tiles

    return GroupedFp8Tiles(block_m=layout.block_m)


def _rows_in(x: jax.Array, spec: ExpertMLPSpec):
    """What the frozen GEMMs read of rows x: x itself, or under FP8 experts (x, its e4m3 rows, their scales), so
    projections that share an input (gate and up) quantize it once."""
    if spec.fp8 is None:
        return x
    from pallas_kernels.grouped_fp8_matmul import e4m3_rows

    return (x, *e4m3_rows(x, spec.fp8))


def _frozen_product(rows, weight, layout: TileLayout, spec: ExpertMLPSpec) -> jax.Array:
    """rows (`_rows_in`) times each row's frozen expert weight."""
    if spec.fp8 is None:
        return grouped_matmul(rows, weight, layout)
    from pallas_kernels.grouped_fp8_matmul import grouped_fp8_product

    x, xq, x_scale = rows
    return grouped_fp8_product(xq, x_scale, weight[0], weight[1], layout.tile_group, _fp8_tiles(layout), x.dtype,
                               spec.fp8)


def _frozen_input_grad(dy: jax.Array, weight, layout: TileLayout, spec: ExpertMLPSpec) -> jax.Array:
    """dy @ W[e] per row: the frozen product's input gradient (under FP8 experts dy's e4m3 rows times Wᵀ's)."""
    if spec.fp8 is None:
        return grouped_matmul_input_grad(dy, weight, layout)
    from pallas_kernels.grouped_fp8_matmul import e4m3_rows, grouped_fp8_product

    return grouped_fp8_product(*e4m3_rows(dy, spec.fp8), weight[2], weight[3], layout.tile_group, _fp8_tiles(layout),
                               dy.dtype, spec.fp8)


def _project(rows, p: ExpertProjection, layout: TileLayout, scale: float, dropout: float,
             key: jax.Array | None, spec: ExpertMLPSpec) -> jax.Array:
    """rows (`_rows_in`) through one projection: the frozen product, its bias, the LoRA term."""
    x = rows if spec.fp8 is None else rows[0]
    y = add_expert_bias(_frozen_product(rows, p.weight, layout, spec), p.bias, layout)
    if p.lora_a is None:
        return y
    return y + _lora(x, p.lora_a, p.lora_b, layout, scale, dropout, key)


def _combine(down_rows: jax.Array, weights: jax.Array, layout: TileLayout, top_k: int) -> jax.Array:
    """Each token's k expert outputs weighted by its routing weights and summed in float32 (the plain
    formulation's rounding)."""
    out = down_rows.at[layout.position].get(unique_indices=True).reshape(-1, top_k, down_rows.shape[-1])
    w = weights.astype(down_rows.dtype)[..., None]
    return jnp.sum((out * w).astype(jnp.float32), axis=1).astype(down_rows.dtype)


def _gathering(spec: ExpertMLPSpec, keys) -> bool:
    """Whether gate and up read their rows from the tokens by index (no LoRA dropout on them, which masks each
    routed row on its own)."""
    return not any(k is not None and d > 0.0 for k, d in zip(keys[:2], spec.dropouts[:2]))


def _project_gathered(x, row_token, p: ExpertProjection, layout: TileLayout, scale: float, spec: ExpertMLPSpec,
                      quantized=None) -> jax.Array:
    """`_project` of the rows x[row_token], each product loading its rows by index (no [rows, hidden] copy); under
    FP8 experts from the tokens' e4m3 rows and scales (`quantized`: a row and its copies share them)."""
    if spec.fp8 is None:
        frozen = gathered_matmul(x, row_token, p.weight, layout)
    else:
        from pallas_kernels.grouped_fp8_matmul import grouped_fp8_product

        frozen = grouped_fp8_product(*quantized, p.weight[0], p.weight[1], layout.tile_group, _fp8_tiles(layout),
                                     x.dtype, spec.fp8, row_token)
    y = add_expert_bias(frozen, p.bias, layout)
    if p.lora_a is None:
        return y
    hidden = gathered_matmul(x, row_token, p.lora_a.astype(x.dtype), layout, trainable=True)
    return y + grouped_matmul(hidden * jnp.asarray(scale, x.dtype), p.lora_b, layout, trainable=True)


def _gate_up_down(x, weights, layout, projections, spec, keys, gather: bool = False):
    """(the output, the routed rows' gate and up outputs) of the plain composition; `gather` (a forward without
    autodiff, `_forward`): gate and up load their rows from the tokens by index where `_gathering` allows."""
    gate_p, up_p, down_p = projections
    if gather and _gathering(spec, keys):
        row_token = row_tokens(layout, spec.top_k)
        quantized = None if spec.fp8 is None else _rows_in(x, spec)[1:]  # the tokens' e4m3 rows, once
        gate = _project_gathered(x, row_token, gate_p, layout, spec.scales[0], spec, quantized)
        up = _project_gathered(x, row_token, up_p, layout, spec.scales[1], spec, quantized)
    else:
        rows = _rows_in(_gather_tokens(x, layout, spec.top_k), spec)
        gate = _project(rows, gate_p, layout, spec.scales[0], spec.dropouts[0], keys[0], spec)
        up = _project(rows, up_p, layout, spec.scales[1], spec.dropouts[1], keys[1], spec)
    down = _project(_rows_in(activate(gate, up, spec), spec), down_p, layout, spec.scales[2], spec.dropouts[2],
                    keys[2], spec)
    return _combine(down, weights, layout, spec.top_k), gate, up


def expert_mlp_reference(x: jax.Array, weights: jax.Array, layout: TileLayout, projections: tuple,
                         spec: ExpertMLPSpec, keys: tuple = (None, None, None)) -> jax.Array:
    """The plain composition (autodiff through every step): what `expert_mlp` computes."""
    return _gate_up_down(x, weights, layout, projections, spec, keys)[0]


def expert_mlp(x: jax.Array, weights: jax.Array, layout: TileLayout, projections: tuple[ExpertProjection, ...],
               spec: ExpertMLPSpec, keys: tuple = (None, None, None)) -> jax.Array:
    """The routed experts' output [tokens, hidden] for tokens x [tokens, hidden], their routing weights [tokens,
    k] (float32) and the padded `layout` of their routed rows; `projections` = (gate, up, down). Gradients flow
    to x, the weights and the LoRA factors; the frozen weights and biases get zeros."""
    return _expert_mlp(spec, x, weights, (layout.position, layout.tile_group, layout.group_sizes),
                       tuple(projections), tuple(keys))


def _no_cotangent(tree: Any) -> Any:
    """Zeros for float leaves, float0 for integer and key leaves."""
    def zero(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)
    return jax.tree.map(zero, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _expert_mlp(spec, x, weights, layout_arrays, projections, keys):
    return _gate_up_down(x, weights, _layout(*layout_arrays, spec), projections, spec, keys, gather=True)[0]


def _forward(spec, x, weights, layout_arrays, projections, keys):
    out, gate, up = _gate_up_down(x, weights, _layout(*layout_arrays, spec), projections, spec, keys, gather=True)
    gate, up = checkpoint_name((gate, up), EXPERT_GATE_UP)
    weights, layout_arrays = checkpoint_name((weights, layout_arrays), EXPERT_ROUTING)
    return out, (x, weights, layout_arrays, projections, keys, gate, up)


def _lora_vjp(x, p: ExpertProjection, layout, scale, dropout, key, cotangent):
    """(the LoRA term's output, its gradient wrt x, dA, dB) for `cotangent`."""
    fn = lambda x, a, b: _lora(x, a, b, layout, scale, dropout, key)  # noqa: E731
    y, vjp = jax.vjp(fn, x, p.lora_a, p.lora_b)
    return (y, *vjp(cotangent))


def _weighted_lora_vjp(x, p: ExpertProjection, layout, scale, dropout, key, dr, w_rows):
    """The LoRA term of a projection whose output rows are weighted by w_rows (down): (the routing weights' part
    <lora row, dr>, the gradient wrt x, dA, dB) for the unweighted cotangent dr. With u = scale · x Aᵀ [rows, r]
    and the term's output (w·u) Bᵀ, the routing weight's part is <u, dr B> over the rank: the [rows, hidden] output
    of the term is never formed (nor reduced against dr)."""
    def hidden(x, a):
        return grouped_matmul(_dropped(x, dropout, key), a, layout, trainable=True) * jnp.asarray(scale, x.dtype)

    u, hidden_vjp = jax.vjp(hidden, x, p.lora_a)
    _, out_vjp = jax.vjp(lambda wu, b: grouped_matmul(wu, b, layout, trainable=True), w_rows * u, p.lora_b)
    v, db = out_vjp(dr)  # v = dr B (per row's expert), dB = Σ drᵀ (w·u)
    d_weight = jnp.sum(u.astype(jnp.float32) * v.astype(jnp.float32), axis=-1)
    dx, da = hidden_vjp((w_rows * v).astype(u.dtype))
    return d_weight, dx, da, db


def _backward(spec, residuals, dout):
    x, weights, layout_arrays, projections, keys, gate, up = residuals
    layout = _layout(*layout_arrays, spec)
    gate_p, up_p, down_p = projections
    k, dtype = spec.top_k, x.dtype
    # the output's cotangent at each routed row, before the routing weight (dr), and the weight per row
    dr = _gather_tokens(dout.astype(dtype), layout, k)
    w_rows = _to_rows(weights.astype(dtype).reshape(-1), layout)[:, None]
    h = activate(gate, up, spec)
    # g = dr @ W_down_eff: dh = w * g, and d(weight) = <down row, dr> = <h, g> (+ the bias's part)
    g = _frozen_input_grad(dr, down_p.weight, layout, spec)
    d_weight = jnp.sum(h.astype(jnp.float32) * g.astype(jnp.float32), axis=-1)
    dh = w_rows * g
    grads = [None, None, None]
    if down_p.lora_a is not None:
        d_weight_lora, dh_lora, da, db = _weighted_lora_vjp(h, down_p, layout, spec.scales[2], spec.dropouts[2],
                                                            keys[2], dr, w_rows)
        d_weight = d_weight + d_weight_lora
        dh = dh + dh_lora
        grads[2] = (da, db)
    if down_p.bias is not None:  # <bias[e], dr> per row, tile by tile
        tiles = layout.rows // layout.block_m
        per_tile = jnp.take(down_p.bias, jnp.maximum(layout.tile_group, 0), axis=0).astype(jnp.float32)
        d_weight = d_weight + jnp.einsum("tmh,th->tm", dr.reshape(tiles, layout.block_m, -1).astype(jnp.float32),
                                         per_tile).reshape(-1)
    _, act_vjp = jax.vjp(lambda a, b: activate(a, b, spec), gate, up)
    dgate, dup = act_vjp(dh.astype(h.dtype))
    drows = (_frozen_input_grad(dgate, gate_p.weight, layout, spec)
             + _frozen_input_grad(dup, up_p.weight, layout, spec))
    if gate_p.lora_a is not None or up_p.lora_a is not None:
        rows = _gather_tokens(x, layout, k)
        for i, (p, d) in enumerate(((gate_p, dgate), (up_p, dup))):
            if p.lora_a is not None:
                _, drows_lora, da, db = _lora_vjp(rows, p, layout, spec.scales[i], spec.dropouts[i], keys[i], d)
                drows = drows + drows_lora
                grads[i] = (da, db)
    # each token's k copies summed (in float32, as the broadcast's transpose)
    dx = drows.at[layout.position].get(unique_indices=True).reshape(-1, k, x.shape[-1])
    dx = jnp.sum(dx.astype(jnp.float32), axis=1).astype(dtype)
    d_weights = d_weight.at[layout.position].get(unique_indices=True).reshape(weights.shape).astype(weights.dtype)
    d_projections = tuple(
        ExpertProjection(jax.tree.map(jnp.zeros_like, p.weight), None if p.bias is None else jnp.zeros_like(p.bias),
                         *(grads[i] if grads[i] is not None else (None, None)))
        for i, p in enumerate(projections))
    return dx, d_weights, _no_cotangent(layout_arrays), d_projections, _no_cotangent(keys)


_expert_mlp.defvjp(_forward, _backward)
