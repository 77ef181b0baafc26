"""The model configuration read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


# The families pyengine implements (the registry maps each to its model class). "gemma3" is Gemma 3's
# multimodal checkpoint, of which the text model (its `text_config`) runs.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "smollm3")

# RoPE types (config.json's rope_type) each family supports.
_LLAMA_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ROPE_TYPES = {
    "llama": _LLAMA_ROPE_TYPES, "mistral": _LLAMA_ROPE_TYPES, "qwen2": _LLAMA_ROPE_TYPES,
    "qwen3": _LLAMA_ROPE_TYPES, "smollm3": _LLAMA_ROPE_TYPES, "gemma2": _LLAMA_ROPE_TYPES,
    "gemma3_text": _LLAMA_ROPE_TYPES, "gemma3": _LLAMA_ROPE_TYPES,
    "phi3": ("default", "longrope"),
}

# Activations of the gated MLP, per family: transformers' `hidden_act` (Llama shape) or
# `hidden_activation` (Gemma) names.
_ACTIVATIONS = {"gemma2": ("gelu_pytorch_tanh",), "gemma3_text": ("gelu_pytorch_tanh",)}

# What transformers' config class of a family assumes for a field config.json leaves out
# (transformers 5.x; configs saved by older versions often hold only the values that differ).
# Gemma 3's text_config in particular usually omits vocab_size, the head counts, head_dim, ...
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, bos_token_id=2, eos_token_id=1, attention_bias=False),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                        tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                        final_logit_softcapping=None, attn_logit_softcapping=None, bos_token_id=2, eos_token_id=1,
                        attention_bias=False, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        sliding_window_pattern=6),
    "phi3": dict(vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                 num_attention_heads=32, hidden_act="silu", max_position_embeddings=4096,
                 original_max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=32000, sliding_window=None),
    "smollm3": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                    num_attention_heads=16, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=32768,
                    rms_norm_eps=1e-6, bos_token_id=128000, eos_token_id=128001, use_sliding_window=False,
                    sliding_window=None, no_rope_layer_interval=4, attention_bias=False, mlp_bias=False,
                    tie_word_embeddings=True),
    "qwen2": dict(max_window_layers=28),
    "qwen3": dict(max_window_layers=28),
}

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' older names of layer types (configuration_utils._LEGACY_LAYER_TYPE_REMAP)
_LAYER_TYPE_ALIASES = {"attention": FULL}


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
    # RoPE scaling when rope_type != "default": config.json's parameters with their "rope_type" (Llama 3:
    # factor, low_freq_factor, high_freq_factor, original_max_position_embeddings; linear: factor;
    # longrope: short_factor, long_factor, original_max_position_embeddings, factor, attention_factor)
    # or, from a GGUF file, freq_factors (one divisor per frequency)
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False                  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False                         # RMSNorm on q and k per head (Qwen3, Gemma 3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # config.json's quantization_config (an AWQ / GPTQ checkpoint), as written
    quantization_config: dict[str, Any] | None = None
    # --- what the families beyond Llama's add (the defaults are the Llama family's) ---
    # per layer, whether it attends within `sliding_window` only (config.json's layer_types);
    # None: every layer does when sliding_window is set (Mistral), none otherwise
    sliding_layers: list[bool] | None = None
    # per layer, whether it applies RoPE (SmolLM3's no_rope_layers); None: every layer does
    rope_layers: list[bool] | None = None
    # RoPE of the sliding-window layers where it differs from the others' (Gemma 3's
    # rope_local_base_freq); None: the same as every layer's
    sliding_rope_theta: float | None = None
    sliding_rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0            # the leading part of each head RoPE rotates (Phi-3)
    hidden_act: str = "silu"                      # the gated MLP's activation
    o_proj_bias: bool = False                     # the attention's output projection carries a bias
    mlp_bias: bool = False                        # gate, up and down projections carry biases
    query_pre_attn_scalar: float | None = None    # softmax scale query_pre_attn_scalar ** -0.5 (Gemma)
    attn_logit_softcapping: float | None = None   # score -> cap * tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # where the decoder's tensors are: "model." (model.embed_tokens.weight, model.layers.N...), or a
    # multimodal checkpoint's language model ("model.language_model.")
    weight_prefix: str = "model."

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "gemma3":
            d = _gemma3_text_config(d)
        family = "gemma3_text" if model_type == "gemma3" else model_type
        d = {**_FAMILY_DEFAULTS.get(family, {}), **d}
        try:
            return cls._from_dict(model_type, family, d)
        except KeyError as e:
            raise ValueError(f"config.json lacks the required field {e.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, model_type: str, family: str, d: dict[str, Any]) -> "ModelConfig":
        is_gemma = family in ("gemma2", "gemma3_text")
        act = d.get("hidden_activation") if is_gemma else d.get("hidden_act", "silu")
        supported_acts = _ACTIVATIONS.get(family, ("silu",))
        if act not in supported_acts:
            raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; supported: "
                             f"{', '.join(repr(a) for a in supported_acts)}")
        if d.get("use_bidirectional_attention"):
            raise ValueError(f"use_bidirectional_attention=True ({model_type}): pyengine runs causal decoders only")
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        num_layers = int(d["num_hidden_layers"])
        head_dim = int(d.get("head_dim") or hidden // heads)
        if family == "phi3":  # transformers' Phi-3 derives it (its config has no head_dim)
            head_dim = hidden // heads

        sliding, sliding_layers = _sliding_layers(model_type, family, d, num_layers)
        if family == "gemma3_text":
            rope_theta, scaling, local_theta, local_scaling = _gemma3_rope(model_type, d)
            partial = 1.0
        else:
            rope_theta, scaling, partial = _rope(model_type, family, d)
            local_theta = local_scaling = None
        rope_layers = None
        if family == "smollm3":
            flags = _smollm3_rope_flags(d, num_layers)
            if not all(flags):
                rope_layers = flags
        if family == "phi3" and scaling is not None:  # its rotary_ndims // 2 factors per list
            for name in ("short_factor", "long_factor"):
                n = len(scaling[name])
                if n != int(head_dim * partial) // 2:
                    raise ValueError(f"rope_parameters' {name} has {n} entries, expected "
                                     f"{int(head_dim * partial) // 2} (half the rotary dimensions)")

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        attention_bias = model_type == "qwen2" or bool(d.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=family in ("qwen3", "gemma3_text"),
            sliding_window=sliding,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization_config=d.get("quantization_config"),
            sliding_layers=sliding_layers,
            rope_layers=rope_layers,
            sliding_rope_theta=local_theta,
            sliding_rope_scaling=local_scaling,
            partial_rotary_factor=float(partial),
            hidden_act=act,
            # Qwen2's output projection has none; Llama's, Qwen3's, SmolLM3's and Gemma's follow attention_bias
            o_proj_bias=attention_bias and model_type not in ("qwen2", "phi3"),
            mlp_bias=family in ("llama", "smollm3") and bool(d.get("mlp_bias", False)),
            query_pre_attn_scalar=float(d["query_pre_attn_scalar"]) if is_gemma else None,
            attn_logit_softcapping=_cap(d.get("attn_logit_softcapping")) if family == "gemma2" else None,
            final_logit_softcapping=_cap(d.get("final_logit_softcapping")) if is_gemma else None,
            weight_prefix="model.language_model." if model_type == "gemma3" else "model.",
        )

    @property
    def layer_sliding_windows(self) -> list[int]:
        """Per layer, the attention window (0: the whole context)."""
        w = self.sliding_window or 0
        if self.sliding_layers is None:
            return [w] * self.num_layers
        return [w if s else 0 for s in self.sliding_layers]

    @property
    def layer_uses_rope(self) -> list[bool]:
        """Per layer, whether it rotates q and k (SmolLM3 skips RoPE in some layers)."""
        return [True] * self.num_layers if self.rope_layers is None else list(self.rope_layers)

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates (all of them but with a
        partial_rotary_factor, as transformers computes it: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

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
        config = cls.from_dict(d)
        if config.model_type == "gemma3":
            config.weight_prefix = _language_model_prefix(Path(model_dir), config.weight_prefix)
        return config

    @property
    def kv_bytes_per_token_per_elem(self) -> int:
        """Elements of K and V one token occupies across all layers."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim


def _cap(v: Any) -> float | None:
    """A soft-capping value: None (or 0) for none."""
    return float(v) if v else None


def _gemma3_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config.json's text model: its text_config, with the top level's token ids,
    tying and quantization where it gives them."""
    text = dict(d.get("text_config") or {})
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings", "quantization_config"):
        if d.get(key) is not None:
            text[key] = d[key]
    text["model_type"] = "gemma3"
    return text


def _smollm3_rope_flags(d: dict[str, Any], num_layers: int) -> list[bool]:
    """Per layer, whether it applies RoPE: SmolLM3Config's no_rope_layers (1 = it does; by default
    every no_rope_layer_interval-th layer does not)."""
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d["no_rope_layer_interval"])
        flags = [(i + 1) % interval != 0 for i in range(num_layers)]
    if len(flags) != num_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers (num_hidden_layers)")
    return [bool(f) for f in flags]


def _layer_types(d: dict[str, Any], num_layers: int, derived: list[bool]) -> list[bool]:
    """Per layer, sliding or not: config.json's layer_types where it has them (transformers 5 writes
    them), else `derived` (what transformers' config class derives from the other fields)."""
    types = d.get("layer_types")
    if types is None:
        return derived
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers (num_hidden_layers)")
    out = []
    for t in types:
        t = _LAYER_TYPE_ALIASES.get(t, t)
        if t not in (SLIDING, FULL):
            raise ValueError(f"unsupported layer type {t!r} in layer_types; supported: {SLIDING!r}, {FULL!r}")
        out.append(t == SLIDING)
    return out


def _sliding_layers(model_type: str, family: str, d: dict[str, Any],
                    num_layers: int) -> tuple[int | None, list[bool] | None]:
    """(the window, which layers use it) as transformers' attention modules of the family decide it,
    in canonical form: (None, None) when no layer has a window, (window, None) when all have."""
    if family == "llama":
        return None, None
    if family in ("mistral", "phi3"):  # one window for every layer, when set
        window = d.get("sliding_window")
        return (int(window), None) if window else (None, None)
    if family in ("qwen2", "qwen3", "smollm3"):
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
        if family == "smollm3":
            uses_rope = _smollm3_rope_flags(d, num_layers)
            derived = [window is not None and not uses_rope[i] for i in range(num_layers)]
        else:
            first = int(d["max_window_layers"])
            derived = [window is not None and i >= first for i in range(num_layers)]
    else:  # gemma2, gemma3_text: sliding and full layers alternate in a pattern
        window = d.get("sliding_window")
        pattern = 2 if family == "gemma2" else int(d.get("sliding_window_pattern") or 6)
        derived = [bool((i + 1) % pattern) for i in range(num_layers)]
    sliding = _layer_types(d, num_layers, derived)
    if not window or not any(sliding):
        return None, None
    return int(window), (None if all(sliding) else sliding)


def _rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def _scaling(model_type: str, family: str, rope_type: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling parameters of `rope_type` (None for "default"), checked to be there."""
    supported = SUPPORTED_ROPE_TYPES[family]
    if rope_type not in supported:
        raise ValueError(f"unsupported rope_type {rope_type!r} for {model_type}; supported: "
                         f"{', '.join(repr(t) for t in supported)}")
    if rope_type == "default":
        return None
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
              "longrope": ("short_factor", "long_factor")}[rope_type]
    missing = [k for k in needed if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_type {rope_type!r} needs {', '.join(repr(k) for k in missing)} in rope_parameters "
                         "(or rope_scaling)")
    return {**params, "rope_type": rope_type}


def _rope(model_type: str, family: str, d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(rope_theta, scaling or None, partial_rotary_factor) of one RoPE for every layer:
    transformers 5's rope_parameters, or the older rope_theta / rope_scaling fields."""
    rope = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    if family == "phi3":
        # Phi3Config: rope_scaling, when given, replaces rope_parameters; "su" and "yarn" are the
        # old names of longrope; original_max_position_embeddings is the config's own field
        params = dict(legacy or rope)
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        partial = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
        rope_type = _rope_type(params)
        if rope_type in ("su", "yarn"):
            rope_type = "longrope"
        scaling = _scaling(model_type, family, rope_type, params)
        if scaling is not None:
            scaling["original_max_position_embeddings"] = int(d["original_max_position_embeddings"])
        if not 0.0 < partial <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial}")
        return theta, scaling, partial
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    scaling = _scaling(model_type, family, rope_type, {**legacy, **rope})
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial} for {model_type} (only phi3 rotates part "
                         "of each head)")
    return theta, scaling, 1.0


def _gemma3_rope(model_type: str,
                 d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float, dict[str, Any] | None]:
    """Gemma 3's two RoPEs, as Gemma3TextConfig builds them: (theta, scaling) of the full-attention
    layers (rope_theta, and rope_scaling if any) and of the sliding-window ones (rope_local_base_freq);
    transformers 5 writes them nested by layer type in rope_parameters."""
    params = d.get("rope_parameters")
    if params is not None and not set(params) & {FULL, SLIDING}:
        raise ValueError(f"rope_parameters of {model_type} are given per layer type ({FULL!r}, {SLIDING!r}), got keys "
                         f"{sorted(params)}")
    params = params or {}
    full = dict(params.get(FULL) or {"rope_type": "default"})
    local = dict(params.get(SLIDING) or {"rope_type": "default"})
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d["rope_theta"])
    local.setdefault("rope_theta", d["rope_local_base_freq"])
    out = []
    for p in (full, local):
        out += [float(p["rope_theta"]), _scaling(model_type, "gemma3_text", _rope_type(p), p)]
    return out[0], out[1], out[2], out[3]


# A multimodal Gemma 3 checkpoint's text decoder: transformers >= 4.52 saves it as
# model.language_model.*, the checkpoints published before as language_model.model.*.
_LEGACY_LANGUAGE_MODEL = "language_model.model."


def _language_model_prefix(model_dir: Path, default: str) -> str:
    """Where the checkpoint in `model_dir` keeps its language model's tensors (the weights' names;
    `default` when they cannot be read here: the loader reports that)."""
    from pyengine.models.loader import checkpoint_files
    try:
        names = checkpoint_files(model_dir)
    except (OSError, ValueError):
        return default
    if any(n.startswith(_LEGACY_LANGUAGE_MODEL) for n in names):
        return _LEGACY_LANGUAGE_MODEL
    return default


def lm_head_name(config: ModelConfig) -> str:
    """The output projection's tensor name (under the language model's prefix in a legacy multimodal
    checkpoint: language_model.lm_head.weight)."""
    return "language_model.lm_head.weight" if config.weight_prefix == _LEGACY_LANGUAGE_MODEL else "lm_head.weight"
