"""Models: config.json parsing, the safetensors loader, the registry of model classes, the
Llama-family model and the families built on it (Gemma 2, Gemma 3, Phi-3, SmolLM3)."""

from pyengine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pyengine.models.llama import AttentionMetadata, LlamaFamilyModel
from pyengine.models.registry import model_class

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "AttentionMetadata", "LlamaFamilyModel", "model_class"]
