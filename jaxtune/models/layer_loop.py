"""The decoder layers' loop for training, with its own VJP: saved activations written in place.

Differentiating `jax.lax.scan` over the layers stores what each layer keeps for the backward pass in stacks
[layers, ...] that the scan first fills with zeros, then overwrites layer by layer: on Llama-3-8B at batch 4
the fill alone moves ~16 GB per step. This loop allocates the stacks uninitialized (on GPU) and writes each
layer's residuals in place; the backward loop reads them in reverse. What a layer keeps is what `jax.vjp` of
its (rematerialized) body keeps, so the remat policies apply unchanged. Residuals that are one of the loop's
inputs (a layer's parameters, the whole-stack NF4 codes, RoPE tables, the layer index) are never copied: the
backward pass takes them from the inputs.

Unrolled (`unrolled=True`), the loop is traced once per layer and each layer's residuals stay buffers of their
own: no stack is written in the forward pass nor sliced in the backward one. Those copies cost every saved
activation a second write and a second read (~3% of a Llama-3-70B step at batch 1 with selective remat); the price
is a compiled program that grows with the layer count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import core as jax_core

from jaxtune.parallel.sharding import current_mesh

# layer_fn(h, per_layer_i, invariant, index) -> h: one decoder layer (h an array, or a pytree of them: the hidden
# states and what the layers accumulate beside them)
LayerFn = Callable[[jax.Array, Any, Any, jax.Array], jax.Array]


@dataclasses.dataclass
class _ResidualLayout:
    """Where each leaf of a layer's VJP comes from in the backward pass: what the layer saved ("stacked", k: its
    own stack in the loop, its own buffer unrolled), an input
    of the loop ("trainable" / "frozen" / "invariant", k; "index"), or a constant of the trace ("static", value)."""

    treedef: Any = None
    sources: list = dataclasses.field(default_factory=list)
    stacked: list = dataclasses.field(default_factory=list)  # avals of the stacked leaves

    def signature(self) -> tuple:
        sources = tuple((kind, type(where) if kind == "static" else where) for kind, where in self.sources)
        return self.treedef.num_leaves, sources, tuple(self.stacked)


def _layout(vjp_fn, trainable_i, frozen_i, invariant, index) -> tuple[_ResidualLayout, list]:
    """The layout of one layer's VJP and its stacked leaves (in order)."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    known = {id(index): ("index", None)}
    for kind, tree in (("invariant", invariant), ("frozen", frozen_i), ("trainable", trainable_i)):
        for k, leaf in enumerate(jax.tree.leaves(tree)):
            known.setdefault(id(leaf), (kind, k))
    layout, stacked = _ResidualLayout(treedef), []
    for leaf in leaves:
        if id(leaf) in known:
            layout.sources.append(known[id(leaf)])
        elif isinstance(leaf, jax_core.Tracer):
            layout.sources.append(("stacked", len(stacked)))
            layout.stacked.append(jax.typeof(leaf))
            stacked.append(leaf)
        else:
            layout.sources.append(("static", leaf))
    return layout, stacked


def _is_primal(x) -> bool:
    return isinstance(x, jax.custom_derivatives.CustomVJPPrimal)


def _is_zero(x) -> bool:
    return isinstance(x, jax.custom_derivatives.SymbolicZero)


def _uninitialized(shape: tuple[int, ...], dtype) -> jax.Array:
    """An array whose contents are never read before being written: uninitialized on GPU and TPU (no fill);
    zeros on a mesh of several devices (where the partitioner must see how it is laid out) and elsewhere."""
    if current_mesh() is not None or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return jnp.zeros(shape, dtype)
    return jax.lax.empty(shape, dtype)


def layer_loop(layer_fn: LayerFn, h: jax.Array, per_layer: Any, invariant: Any, num_layers: int, *,
               unrolled: bool = False, first_index: int = 0) -> jax.Array:
    """h after `num_layers` layers: layer i runs `layer_fn(h, per_layer[i], invariant, first_index + i)`.

    `per_layer` leaves carry a leading layer axis; `invariant` holds the loop's constants, which are never
    differentiated. The backward pass computes gradients for the `per_layer` leaves being differentiated only.
    `unrolled`: one traced layer per layer instead of a loop (residuals kept without stacks). A rematerialized
    `layer_fn` must then prevent CSE, or the compiler merges the backward's recomputation into the forward pass.
    """
    layer_leaves, layer_tree = jax.tree.flatten(per_layer)
    inv_leaves, inv_tree = jax.tree.flatten(invariant)
    indices = jnp.arange(first_index, first_index + num_layers, dtype=jnp.int32)
    traced: dict[str, Any] = {}  # what the forward rule learned for the backward rule: layout, trained leaves

    def call_layer(h, leaves_i, inv_leaves, i):
        return layer_fn(h, jax.tree.unflatten(layer_tree, leaves_i), jax.tree.unflatten(inv_tree, inv_leaves), i)

    @jax.custom_vjp
    def run(h, layer_leaves, inv_leaves):
        def body(h, xs):
            leaves_i, i = xs
            return call_layer(h, leaves_i, inv_leaves, i), None

        return jax.lax.scan(body, h, (layer_leaves, indices))[0]

    def one_layer_vjp(h, t_i, f_i, inv, i, trained):
        """(output, VJP in h and the differentiated leaves t_i); f_i the other leaves of the layer."""
        def layer(h, t_i):
            it_t, it_f = iter(t_i), iter(f_i)
            return call_layer(h, [next(it_t) if d else next(it_f) for d in trained], inv, i)

        return jax.vjp(layer, h, t_i)

    def layer_slices(t_stack, f_stack, i: int, h):
        """Layer i's leaves, its index tied to `h`: all a layer does (its weights' dequantization included,
        which reads the whole-stack codes at the index) waits for the layer before it, as in the loop; free,
        the compiler runs every layer's dequantization early and keeps the weights alive (+13 GiB at 70B)."""
        h, index = jax.lax.optimization_barrier((h, jnp.int32(first_index + i)))
        return h, [x[i] for x in t_stack], [x[i] for x in f_stack], index

    def split(leaves, trained):
        return [x for x, d in zip(leaves, trained) if d], [x for x, d in zip(leaves, trained) if not d]

    def run_fwd(h, layer_leaves, inv_leaves):
        if any(x.perturbed for x in inv_leaves):
            raise NotImplementedError("the layer loop does not differentiate its loop constants")
        trained = traced["trained"] = tuple(x.perturbed for x in layer_leaves)
        h = jax.tree.map(lambda x: x.value, h, is_leaf=_is_primal)
        layer_leaves = [x.value for x in layer_leaves]
        inv_leaves = [x.value for x in inv_leaves]
        t_stack, f_stack = split(layer_leaves, trained)
        if unrolled:
            return unrolled_fwd(h, t_stack, f_stack, inv_leaves)

        # the stacks' shapes come from tracing one layer; the loop below traces it again and must agree
        def probe(h, t_i, f_i, inv, i):
            layout, stacked = _layout(one_layer_vjp(h, t_i, f_i, inv, i, trained)[1], t_i, f_i, inv, i)
            traced["layout"] = layout
            return stacked

        first = lambda leaves: [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in leaves]  # noqa: E731
        jax.eval_shape(probe, h, first(t_stack), first(f_stack), inv_leaves, jax.ShapeDtypeStruct((), jnp.int32))
        layout = traced["layout"]
        stacks = [_uninitialized((num_layers, *a.shape), a.dtype) for a in layout.stacked]

        def body(carry, xs):
            h, stacks, inv = carry
            t_i, f_i, i = xs
            out, vjp_fn = one_layer_vjp(h, t_i, f_i, inv, i, trained)
            got, stacked = _layout(vjp_fn, t_i, f_i, inv, i)
            if got.signature() != layout.signature():
                raise RuntimeError("a decoder layer traced twice kept different residuals (a layer whose "
                                   "trace is not deterministic cannot run in the layer loop)")
            traced["layout"] = got  # the backward pass runs this trace's VJP (the probe's was of another trace)
            stacks = [jax.lax.dynamic_update_index_in_dim(s, r, i - first_index, 0) for s, r in zip(stacks, stacked)]
            return (out, stacks, inv), None

        (out, stacks, _), _ = jax.lax.scan(body, (h, stacks, inv_leaves), (t_stack, f_stack, indices))
        return out, (stacks, t_stack, f_stack, inv_leaves)

    def unrolled_fwd(h, t_stack, f_stack, inv_leaves):
        layouts, kept = [], []
        for i in range(num_layers):
            h, t_i, f_i, index = layer_slices(t_stack, f_stack, i, h)
            h, vjp_fn = one_layer_vjp(h, t_i, f_i, inv_leaves, index, traced["trained"])
            layout, stacked = _layout(vjp_fn, t_i, f_i, inv_leaves, index)
            layouts.append(layout)
            kept.append(stacked)
        traced["layouts"] = layouts
        return h, (kept, t_stack, f_stack, inv_leaves)

    def layer_vjp(layout, kept_i, t_i, f_i, inv_leaves, i):
        """Layer i's VJP rebuilt from what it kept and the loop's inputs."""
        inputs = {"trainable": t_i, "frozen": f_i, "invariant": inv_leaves}
        leaves = []
        for kind, where in layout.sources:
            if kind == "stacked":
                leaves.append(kept_i[where])
            elif kind == "index":
                leaves.append(i)
            elif kind == "static":
                leaves.append(where)
            else:
                leaves.append(inputs[kind][where])
        return jax.tree.unflatten(layout.treedef, leaves)

    def run_bwd(residuals, dh):
        saved, t_stack, f_stack, inv_leaves = residuals  # stacks, or unrolled each layer's own list
        trained = traced["trained"]
        # an output (or a part of the carry) that takes no part in the loss
        dh = jax.tree.map(lambda d: jnp.zeros(d.shape, d.dtype) if _is_zero(d) else d, dh, is_leaf=_is_zero)
        if unrolled:
            grads = [None] * num_layers
            for i in reversed(range(num_layers)):
                dh, t_i, f_i, index = layer_slices(t_stack, f_stack, i, dh)
                dh, grads[i] = layer_vjp(traced["layouts"][i], saved[i], t_i, f_i, inv_leaves, index)(dh)
            dt_stack = [jnp.stack(g) for g in zip(*grads)] if t_stack else []
        else:
            def body(dh, xs):
                t_i, f_i, i, stacked_i = xs
                return layer_vjp(traced["layout"], stacked_i, t_i, f_i, inv_leaves, i)(dh)

            dh, dt_stack = jax.lax.scan(body, dh, (t_stack, f_stack, indices, saved), reverse=True)
        it = iter(dt_stack)
        return dh, [next(it) if d else None for d in trained], [None] * len(inv_leaves)

    run.defvjp(run_fwd, run_bwd, symbolic_zeros=True)
    return run(h, layer_leaves, inv_leaves)
