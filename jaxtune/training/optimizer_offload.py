"""The optimizer state in host memory between steps (`TrainConfig.offload_optimizer`).

The state (AdamW's moments) is read only by the update at the end of a step, so on a GPU it need not occupy device
memory while the forward and backward passes run, where the step's peak is. It is kept in the device's pinned host
memory; the step copies it in after the gradients exist (an optimization barrier orders the copy after the backward
pass) and returns the updated state to host memory.
"""

from __future__ import annotations

import jax


def place_on_host(tree):
    """Each array of `tree` moved to pinned host memory, its sharding otherwise kept."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")), tree)


def to_device_after(opt_state, grads):
    """(grads, opt_state on the device) inside a step: the copy in cannot start before `grads` are computed."""
    grads, opt_state = jax.lax.optimization_barrier((grads, opt_state))
    return grads, jax.device_put(opt_state, jax.memory.Space.Device)


def to_host(opt_state):
    """The updated state, inside a step, returned in host memory."""
    return jax.device_put(opt_state, jax.memory.Space.Host)
