"""The model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# "org/name" (one slash, no leading "/", "." or "~"): what a Hugging Face Hub id looks like.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_CHECKPOINT_FILE = re.compile(r"config\.json|.*\.safetensors|model\.safetensors\.index\.json|tokenizer.*\.json")


def check_model_dir(model_dir: str | Path) -> Path:
    """Returns `model_dir` as a Path if it is an existing directory or an existing GGUF file
    (a name ending in .gguf); otherwise raises FileNotFoundError (nothing there; pyengine loads
    local models only, never from the Hugging Face Hub) or NotADirectoryError (another file),
    saying which."""
    path = Path(model_dir)
    if path.is_dir():
        return path
    is_gguf = path.suffix.lower() == ".gguf"
    if is_gguf and path.is_file():
        return path
    if path.exists():
        hint = ""
        if _CHECKPOINT_FILE.fullmatch(path.name):
            hint = f" (the directory that holds it is {str(path.parent)!r})"
        raise NotADirectoryError(f"model path {str(model_dir)!r} is a file, not a directory: pass the model "
                                 f"directory, the one that holds config.json and the *.safetensors files{hint}, "
                                 "or a GGUF file (*.gguf)")
    if is_gguf:
        raise FileNotFoundError(f"GGUF file {str(model_dir)!r} does not exist")
    if _HUB_ID.fullmatch(str(model_dir)):
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} does not exist: pyengine loads models from local directories "
            "only and does not download from the Hugging Face Hub; if this is a Hub id, download it first "
            f"(e.g. `hf download {model_dir} --local-dir DIR`) and pass DIR")
    raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist (pyengine loads models from a "
                            "local directory: config.json, *.safetensors, tokenizer files; or from a GGUF file)")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    # Llama 3 RoPE scaling when rope_type != "default": config.json's parameters (factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings) or, from a GGUF file, freq_factors (one
    # divisor per frequency)
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False                  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False                         # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # config.json's quantization_config (an AWQ / GPTQ checkpoint), as written
    quantization_config: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; only 'silu' is supported")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            rope = d.get("rope_parameters") or {}
            legacy_scaling = d.get("rope_scaling") or {}
            rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", legacy_scaling.get("rope_type", legacy_scaling.get("type", "default")))
            if rope_type not in ("default", "llama3"):
                raise ValueError(f"unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'")
            scaling = None
            if rope_type == "llama3":
                scaling = {**legacy_scaling, **rope}
            partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
            if partial != 1.0:
                raise ValueError(f"unsupported partial_rotary_factor {partial}")
            eos = d.get("eos_token_id")
            eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
            sliding = None
            if model_type == "mistral":
                sliding = d.get("sliding_window")
            elif d.get("use_sliding_window"):
                sliding = d.get("sliding_window")
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=model_type == "qwen3",
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
                quantization_config=d.get("quantization_config"),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the required field {e.args[0]!r}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        """The config of a Hugging Face model directory (its config.json), or of a GGUF file (its
        metadata)."""
        if check_model_dir(model_dir).is_file():
            from pyengine.gguf import model_config, read_header
            return model_config(read_header(model_dir))
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(model_dir)!r}: a model directory holds "
                                    "a Hugging Face checkpoint (config.json, *.safetensors, tokenizer files)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed {path}: {e}") from None
        return cls.from_dict(d)

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """Elements of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim
