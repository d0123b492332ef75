"""Quantization to the formats a fine-tune is deployed in (llama.cpp's GGUF block formats)."""

from jaxtune.quant.k_quants import (dequantize_q4_k, dequantize_q5_k, dequantize_q6_k, quantize_q4_k, quantize_q5_k,
                                   quantize_q6_k)
from jaxtune.quant.q4_0 import dequantize_q4_0, quantize_q4_0

__all__ = ["dequantize_q4_0", "dequantize_q4_k", "dequantize_q5_k", "dequantize_q6_k", "quantize_q4_0", "quantize_q4_k", "quantize_q5_k",
           "quantize_q6_k"]
