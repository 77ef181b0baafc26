"""A GGUF file's metadata -> pyengine's ModelConfig: the keys llama.cpp's converter writes for
the llama (Llama, Mistral), qwen2 and qwen3 architectures."""

from __future__ import annotations

from typing import Any

import numpy as np

from pyengine.gguf.header import GGUFHeader
from pyengine.models.config import ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "model_config", "ROPE_FREQS"]

# general.architecture -> ModelConfig.model_type (Mistral's GGUF files say "llama")
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# Llama 3.1's frequency-dependent RoPE scaling: llama.cpp's converter stores it as this tensor of
# per-frequency divisors, not as metadata.
ROPE_FREQS = "rope_freqs.weight"


def model_config(header: GGUFHeader) -> ModelConfig:
    """The model configuration the file's metadata describes. ValueError naming the key and the
    value for what pyengine does not support (another architecture, a mixture of experts, RoPE
    scaling other than Llama 3's, per-layer head counts, ...) or a missing required key."""
    path = str(header.path)
    arch = header.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r}: unsupported architecture {arch!r} (general.architecture); "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (Mistral files say llama)")

    def key(name: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{name}"
        if full not in header.metadata:
            if full in header.array_lengths:
                raise ValueError(f"GGUF file {path!r}: {full} is an array (one value per layer?); pyengine "
                                 "supports one value for all layers")
            if required:
                raise ValueError(f"GGUF file {path!r} lacks the required metadata key {full!r}")
            return default
        value = header.metadata[full]
        if isinstance(value, list):
            raise ValueError(f"GGUF file {path!r}: {full} = {value!r} is an array (one value per layer?); "
                             "pyengine supports one value for all layers")
        return value

    experts = key("expert_count", 0, required=False)
    if experts:
        raise ValueError(f"GGUF file {path!r}: {arch}.expert_count = {experts}: mixture-of-experts models are "
                         "not supported")
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads, required=False))
    value_dim = int(key("attention.value_length", head_dim, required=False))
    if value_dim != head_dim:
        raise ValueError(f"GGUF file {path!r}: {arch}.attention.value_length = {value_dim} differs from "
                         f"{arch}.attention.key_length = {head_dim}; pyengine needs them equal")
    rope_dim = int(key("rope.dimension_count", head_dim, required=False))
    if rope_dim != head_dim:
        raise ValueError(f"GGUF file {path!r}: {arch}.rope.dimension_count = {rope_dim} rotates part of each "
                         f"head (head_dim {head_dim}); pyengine supports RoPE over the whole head only")
    vocab = _vocab_size(header, arch, key("vocab_size", None, required=False))
    eos = [header.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = header.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        model_type=SUPPORTED_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads, required=False)),
        head_dim=head_dim,
        rms_norm_eps=_float32_value(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        rope_theta=_float32_value(key("rope.freq_base", 10000.0, required=False)),
        rope_scaling=_rope_scaling(header, arch, key, head_dim),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in header.tensors,
        qk_norm=arch == "qwen3",
        sliding_window=None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )


def _vocab_size(header: GGUFHeader, arch: str, declared: Any) -> int:
    """{arch}.vocab_size if given, else the rows of the embedding table, else the token list's length."""
    if declared is not None:
        return int(declared)
    embd = header.tensors.get("token_embd.weight")
    if embd is not None and len(embd.shape) == 2:
        return embd.shape[0]
    if "tokenizer.ggml.tokens" in header.array_lengths:
        return header.array_lengths["tokenizer.ggml.tokens"]
    raise ValueError(f"GGUF file {str(header.path)!r}: no vocabulary size ({arch}.vocab_size, token_embd.weight "
                     "or tokenizer.ggml.tokens)")


def _float32_value(v: Any) -> float:
    """A value GGUF stores as float32 (1e-6 arrives as 9.99999997e-07), as the shortest decimal that
    rounds to that float32 -- the value the model's config.json gave, and in float32 the same."""
    return float(str(np.float32(v)))


def _rope_scaling(header: GGUFHeader, arch: str, key: Any, head_dim: int) -> dict[str, Any] | None:
    """None (plain RoPE), or Llama 3's frequency scaling given as llama.cpp's per-frequency divisors."""
    kind = key("rope.scaling.type", "none", required=False)
    factor = key("rope.scaling.factor", 1.0, required=False)
    if kind not in ("none", "") and not (kind == "linear" and float(factor) == 1.0):
        raise ValueError(f"GGUF file {str(header.path)!r}: unsupported RoPE scaling {kind!r} "
                         f"({arch}.rope.scaling.type, factor {factor}); supported: none, and Llama 3's frequency "
                         f"scaling ({ROPE_FREQS})")
    if ROPE_FREQS not in header.tensors:
        return None
    from pyengine.gguf.weights import read_float_tensor  # a small tensor, read now

    freqs = read_float_tensor(header, ROPE_FREQS)
    if tuple(freqs.shape) != (head_dim // 2,):
        raise ValueError(f"GGUF file {str(header.path)!r}: tensor {ROPE_FREQS!r} has shape {tuple(freqs.shape)}, "
                         f"expected ({head_dim // 2},): one factor per frequency of a head of {head_dim}")
    return {"rope_type": "llama3", "freq_factors": [float(x) for x in freqs.tolist()]}
