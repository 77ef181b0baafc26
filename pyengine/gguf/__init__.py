"""GGUF files (llama.cpp's format): model configuration, tokenizer and weights, read with the
`gguf` package. `Engine("model.gguf")` goes through here; see README.md ("GGUF files").

    header = read_header(path)                 # metadata and tensor table; the file is not kept mapped
    config = model_config(header)              # -> ModelConfig
    tokenizer = load_tokenizer(header)         # -> a transformers fast tokenizer, or None
    weights = load_weights(header, config, names, dtype)
"""

from pyengine.gguf.config import SUPPORTED_ARCHITECTURES, model_config
from pyengine.gguf.header import GGUFHeader, GGUFTensorInfo, read_header
from pyengine.gguf.tokenizer import load_tokenizer
from pyengine.gguf.weights import gguf_name, load_weights, quant_types, supported_types

__all__ = ["SUPPORTED_ARCHITECTURES", "GGUFHeader", "GGUFTensorInfo", "gguf_name", "load_tokenizer", "load_weights",
           "model_config", "quant_types", "read_header", "supported_types"]
