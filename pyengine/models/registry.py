"""Which model class serves which Hugging Face `model_type`."""

from __future__ import annotations

from pyengine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pyengine.models.gemma2 import Gemma2Model
from pyengine.models.gemma3 import Gemma3TextModel
from pyengine.models.llama import LlamaFamilyModel
from pyengine.models.phi3 import Phi3Model
from pyengine.models.smollm3 import SmolLM3Model

# model_type -> the class that loads its weights and runs its forward
MODEL_CLASSES: dict[str, type[LlamaFamilyModel]] = {
    "llama": LlamaFamilyModel,
    "mistral": LlamaFamilyModel,     # + sliding window
    "qwen2": LlamaFamilyModel,       # + q/k/v biases, sliding window on some layers
    "qwen3": LlamaFamilyModel,       # + q/k RMSNorm
    "smollm3": SmolLM3Model,         # + layers without RoPE
    "phi3": Phi3Model,               # fused qkv / gate_up tensors, partial RoPE, LongRoPE
    "gemma2": Gemma2Model,           # Gemma norms, soft-capping, GeGLU, scaled embeddings
    "gemma3_text": Gemma3TextModel,  # + Gemma q/k norms, a RoPE per layer type
    "gemma3": Gemma3TextModel,       # its text model
}
assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def model_class(config: ModelConfig) -> type[LlamaFamilyModel]:
    """The class for a parsed config (ModelConfig has already rejected unknown model types)."""
    return MODEL_CLASSES[config.model_type]
