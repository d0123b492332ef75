"""Checkpoint I/O at the edges: HF safetensors, bnb-4bit and GGUF in; jaxtune checkpoints out and in."""

from convert.convert import convert
from convert.load import from_pretrained, load_model, open_checkpoint

__all__ = ["convert", "from_pretrained", "load_model", "open_checkpoint"]
