"""Which model class serves which Hugging Face `model_type`."""

from __future__ import annotations

from pyengine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pyengine.models.llama import LlamaFamilyModel

# model_type -> the class that loads its weights and runs its forward
MODEL_CLASSES: dict[str, type[LlamaFamilyModel]] = {
    "llama": LlamaFamilyModel,
    "mistral": LlamaFamilyModel,   # + sliding window
    "qwen2": LlamaFamilyModel,     # + q/k/v biases
    "qwen3": LlamaFamilyModel,     # + q/k RMSNorm
}
assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)


def model_class(config: ModelConfig) -> type[LlamaFamilyModel]:
    """The class for a parsed config (ModelConfig has already rejected unknown model types)."""
    return MODEL_CLASSES[config.model_type]
