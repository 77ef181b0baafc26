"""Models: config.json parsing, the safetensors loader, the registry of model classes, and the
Llama-family model."""

from pyengine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pyengine.models.llama import AttentionMetadata, LlamaFamilyModel
from pyengine.models.registry import model_class

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "AttentionMetadata", "LlamaFamilyModel", "model_class"]
