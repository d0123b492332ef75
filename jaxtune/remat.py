"""The rematerialization policies of the decoder layers' scan: what each layer keeps for its backward pass."""

from __future__ import annotations

import jax

# What the "selective" policy keeps per layer: every projection output but down_proj's (whose only user is the
# residual add), the attention output and its logsumexp, LoRA's rank-r hidden. The backward pass then
# recomputes only norms, RoPE and SwiGLU (elementwise) and never a matmul or the attention forward.
SELECTIVE_SAVED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "attention_out",
                   "attention_lse", "lora_hidden")


# cuDNN's fused attention forward (its output and softmax statistics): kept like the Pallas kernel's residuals
CUDNN_ATTENTION_FORWARD = "dot_product_attention_fwd_wrapper"


_SAVE_NAMED = jax.checkpoint_policies.save_only_these_names(*SELECTIVE_SAVED)


def _save_selective(prim, *args, **params) -> bool:
    return prim.name == CUDNN_ATTENTION_FORWARD or _SAVE_NAMED(prim, *args, **params)


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
        "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        # each layer's input goes to host memory in the forward pass and comes back for its recompute
        "offload": offload_only("layer_input"),
    }
    if name not in policies:
        raise ValueError(f"unknown remat policy {name!r}; choose one of: none, {', '.join(policies)}")
    return policies[name]
