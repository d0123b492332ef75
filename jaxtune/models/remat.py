"""The rematerialization policies of the decoder layers' scan (what each layer keeps for its backward pass), and
remat "offload"'s long-context layout of the scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# What the "selective" policy keeps per layer: every projection output but down_proj's (whose only user is the
# residual add), the attention output and its logsumexp, LoRA's rank-r hidden; in a Gated DeltaNet layer its input
# projections' outputs and the gated delta rule's output; in a sparse MoE layer the routed rows' gate/up outputs
# and the routing (jaxtune/moe/expert_mlp.py). The backward pass then recomputes only norms, RoPE, the short
# convolution and SwiGLU (elementwise) and never a matmul, the attention forward or the rule's forward.
SELECTIVE_SAVED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "attention_out",
                   "attention_lse", "lora_hidden", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                   "linear_attention_out", "expert_gate_up", "expert_routing")


# cuDNN's fused attention forward (its output and softmax statistics): kept like the Pallas kernel's residuals
CUDNN_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


_SAVE_NAMED = jax.checkpoint_policies.save_only_these_names(*SELECTIVE_SAVED)
# "selective" but a sparse MoE block's routed rows are not kept: its backward runs the block's forward again (the
# gate / up / down GEMMs of every routed row: a third more expert FLOPs) from the layer's saved input. The routed
# rows' gate/up outputs are the largest residual of a mixture of experts (two [tokens * k, moe_intermediate]
# arrays per layer: 1.5 GiB at Qwen3-30B-A3B's 65,536 tokens in bf16), the rest of "selective" a small part of it.
_SAVE_NAMED_BUT_EXPERTS = jax.checkpoint_policies.save_only_these_names(
    *(n for n in SELECTIVE_SAVED if n not in ("expert_gate_up", "expert_routing")))


def _save_selective(prim, *args, **params) -> bool:
    return prim.name == CUDNN_ATTENTION_FORWARD or _SAVE_NAMED(prim, *args, **params)


def _save_selective_but_experts(prim, *args, **params) -> bool:
    return prim.name == CUDNN_ATTENTION_FORWARD or _SAVE_NAMED_BUT_EXPERTS(prim, *args, **params)


def offload_only(name: str):
    """Saves nothing but the values named `name`, which go to pinned host memory."""
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(name,),
        offload_src="device", offload_dst="pinned_host")


def remat_policy(name: str):
    """Named rematerialization policies for the per-layer scan body."""
    policies = {
        "full": jax.checkpoint_policies.nothing_saveable,
        "selective": _save_selective,
        "selective-experts": _save_selective_but_experts,
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        # each layer's input goes to host memory in the forward pass and comes back for its recompute
        "offload": offload_only("layer_input"),
    }
    if name not in policies:
        raise ValueError(f"unknown remat policy {name!r}; choose one of: none, {', '.join(policies)}")
    return policies[name]


def split_offload_scan(layer_body, h, layer_state, layer_rngs, layers: int, group: int, on_device: int):
    """Long-context layout: the inputs of the first layers go to host memory, one per `group` layers (the
    layers inside a group rematerialized from its input while its backward runs); the last `on_device`
    layers keep their inputs in device memory. `layer_body(h, (layer state, None, rng))` runs one layer of the
    stacked `layer_state`."""
    offloaded = layers - on_device
    if not 0 <= on_device <= layers:
        raise ValueError(f"offload_device_layers={on_device} is not between 0 and the {layers} layers")
    if offloaded % group:
        raise ValueError(f"offload_group={group} does not divide the {offloaded} offloaded layers "
                         f"({layers} layers, {on_device} kept on device)")

    # the scans run over layer indices and read the stacked weights in place: slicing the stack into the
    # two parts would copy every layer's weights
    def per_layer(h, index):
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False)  # noqa: E731
        return layer_body(h, (jax.tree.map(pick, layer_state), None,
                              None if layer_rngs is None else pick(layer_rngs)))

    if offloaded:
        inner = jax.checkpoint(per_layer, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)

        def group_body(h, indices):
            h = jax.tree.map(lambda a: checkpoint_name(a, "group_input"), h)
            h, _ = jax.lax.scan(inner, h, indices)
            return h, None

        group_body = jax.checkpoint(group_body, policy=offload_only("group_input"), prevent_cse=False)
        h, _ = jax.lax.scan(group_body, h, jnp.arange(offloaded).reshape(offloaded // group, group))
    if on_device:
        kept = jax.checkpoint(per_layer, policy=jax.checkpoint_policies.save_only_these_names("layer_input"),
                              prevent_cse=False)
        h, _ = jax.lax.scan(kept, h, jnp.arange(offloaded, layers))
    return h
