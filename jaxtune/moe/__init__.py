"""Mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral): routing, grouped expert GEMMs, NF4 experts and
their LoRA adapters."""

from jaxtune.moe.block import SparseMoE
from jaxtune.moe.experts import ExpertLinear, LoRAExperts, NF4Experts
from jaxtune.moe.grouped import grouped_matmul
from jaxtune.moe.layout import TileLayout, tile_layout
from jaxtune.moe.routing import Routing, route

__all__ = ["ExpertLinear", "LoRAExperts", "NF4Experts", "Routing", "SparseMoE", "TileLayout", "grouped_matmul", "route",
           "tile_layout"]
