"""Quantized weights: llama.cpp's block formats (Q8_0, Q5_0, Q5_1, Q4_0, Q4_K, Q5_K, Q6_K),
quantize-on-load, and the CPU kernels that compute with them (csrc/include/pyengine/cpu_quant.h)."""

from pyengine.quant.formats import QUANT_FORMATS, QuantFormat, quant_format
from pyengine.quant.weight import QuantizedWeight

__all__ = ["QUANT_FORMATS", "QuantFormat", "QuantizedWeight", "quant_format"]
