"""The frozen input embedding in host memory during training (`TrainConfig.offload_embedding`).

The table (vocab x hidden: 1 GiB at Llama-3-8B, 2 GiB at 70B) is read once per micro-batch, by the lookup that
starts the forward pass, and never by the backward pass (it is frozen, and the ids have no gradient). Kept in the
device's pinned host memory, it is copied in for that lookup only (`Embed` does the copy when its table is in
host memory), so the step's peak, in the backward pass, is 1-2 GiB lower on small cards for a host-to-device copy
of the table per micro-batch.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxtune.errors import JaxtuneError
from jaxtune.models.causal_lm import CausalLM
from jaxtune.training.optimizer_offload import place_on_host


def check_untied(model: CausalLM) -> None:
    """A tied model reads its embedding as the output head in every backward pass: nothing would be saved."""
    if model.lm_head is None:
        raise JaxtuneError("offload_embedding needs a model with its own output head; this one ties it to the input "
                           "embedding (tie_word_embeddings), which every step reads: drop --offload-embedding")


def _is_table(path) -> bool:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return "embed_tokens" in names and "weight" in names


def embedding_to_host(model: CausalLM, frozen: Any) -> Any:
    """`frozen` (the step's frozen state, or DPO's (state, reference adapters)) with the embedding table in pinned
    host memory; the model holds that same host array, so the device copy is released."""
    check_untied(model)
    table = model.embed_tokens.weight[...]
    found = []

    def place(path, x):
        if not _is_table(path):
            return x
        found.append(place_on_host(x))
        return found[-1]

    frozen = jax.tree_util.tree_map_with_path(place, frozen)
    if len(found) != 1 or found[0].shape != table.shape:
        raise RuntimeError(f"expected one embedding table in the frozen state, found {len(found)}")
    model.embed_tokens.weight.set_value(found[0])
    return frozen


def embedding_to_device(model: CausalLM) -> None:
    """The model's table back in device memory (after training: generation and export read it there)."""
    table = model.embed_tokens.weight[...]
    if jax.typeof(table).memory_space == jax.memory.Space.Host:
        model.embed_tokens.weight.set_value(jax.device_put(table, table.sharding.with_memory_kind("device")))
