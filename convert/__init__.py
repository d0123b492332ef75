"""Checkpoint I/O at the edges: HF safetensors and GGUF in (more formats as they land)."""

from convert.load import from_pretrained, load_model, open_checkpoint

__all__ = ["from_pretrained", "load_model", "open_checkpoint"]
