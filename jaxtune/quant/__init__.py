"""Quantization to the formats a fine-tune is deployed in (llama.cpp's GGUF block formats)."""

from jaxtune.quant.q4_0 import dequantize_q4_0, quantize_q4_0

__all__ = ["dequantize_q4_0", "quantize_q4_0"]
