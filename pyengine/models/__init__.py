"""Model definitions and the checkpoint loader."""

from pyengine.models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from pyengine.models.llama import AttentionMetadata, LlamaFamilyModel

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelConfig", "AttentionMetadata", "LlamaFamilyModel"]
