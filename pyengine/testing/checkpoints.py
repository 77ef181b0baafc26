"""Tiny real Hugging Face checkpoints, built offline.

Used by the tests, the demo CLI and the benchmarks. Everything here is built locally:
a byte-level BPE tokenizer trained with ``tokenizers`` on a small built-in corpus, and
random-weight models of every family pyengine runs (``llama``, ``mistral``, ``qwen2``,
``qwen3``, ``gemma2``, ``gemma3_text``, ``phi3``, ``smollm3``; and Gemma 3's multimodal
``gemma3``) saved with ``save_pretrained`` as safetensors, exactly as a downloaded checkpoint
would be laid out (config.json, generation_config.json, model*.safetensors, tokenizer files).

This module depends only on the standard library, torch, transformers and tokenizers, so
that it can be used without the compiled engine.

Logit margins
-------------
Random-weight models have nearly flat logits, so greedy comparisons between an engine and
the reference can flip on rounding noise. Measured here (HF, fp64 as truth, 4 model types x
2 seeds, default tiny shape, 32 random prompts x 48 greedy tokens; see ``logit_margins``
and bench/README.md), the gap between the two largest logits *relative to the largest
|logit|* does not depend on ``initializer_range``: RMSNorm removes the scale, and the
median relative gap is ~0.07 with ~1% of positions below 1e-3 at every range from 0.02 to
0.5. What the range changes is how much the network amplifies rounding noise (the residual
branches grow like range x hidden_size) and whether generations are degenerate:

    range  fp32 noise  bf16 noise  bf16 argmax flips  distinct generated tokens
    0.02   2.7e-7      0.006       1.4%               0.62 (min 0.15; 0.05 on 150 tokens)
    0.05   3.7e-7      0.009       2.3%               0.35
    0.1    5.4e-7      0.013       2.7%               0.55
    0.2    9.5e-7      0.023       4.0%               0.87 (min 0.76)
    0.5    1.4e-6      0.038       7.8%               0.88

(noise: max |logit - fp64 logit| / max |fp64 logit|, median over positions). A *larger*
range therefore does not buy margin; it buys noise. Too small a range gives a model that
repeats one token, which would hide KV-cache bugs. ``DEFAULT_INITIALIZER_RANGE`` = 0.2 is
at the low-noise end of the diverse regime (from ~0.15 up, generations keep >= 0.6
distinct tokens over 150 tokens, also at hidden 128 / 4 layers); there the median relative top-2 gap (~0.07)
is ~7e4 times the fp32 noise, no fp32 greedy sequence differed from fp64, and fewer than
0.1% of positions have a relative gap below 1e-4. In bf16 the noise (~2%) is within a
factor 3 of the median gap, so bf16 comparisons must be top-k tolerant (as vLLM's
``check_logprobs_close``), whatever the range.

Random models also start with all RMSNorm weights at 1 (Gemma's, which scale by 1 + w, at 0)
and all biases at 0, which would let a loader that forgets them pass every test.
``build_tiny_checkpoint`` therefore perturbs every norm weight (input, post-attention,
pre-/post-feedforward, q/k and final norms: + N(0, 0.1)) and gives biases (Qwen2's q/k/v)
N(0, 0.1) values, unless ``perturb_norms_and_biases=False``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

# Relative: this package also loads on its own, without the compiled engine (bench/common.py).
from .tokenizer import (BOS_TOKEN, CORPUS, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, UNK_TOKEN,  # noqa: F401
                        build_tokenizer)

__all__ = [
    "build_config",
    "checkpoint_digest",
    "CORPUS",
    "DEFAULT_INITIALIZER_RANGE",
    "MODEL_TYPES",
    "MULTIMODAL_GEMMA3",
    "SMOLLM_135M_SHAPE",
    "QWEN3_06B_SHAPE",
    "TINY_SHAPES",
    "BOS_TOKEN",
    "EOS_TOKEN",
    "UNK_TOKEN",
    "PAD_TOKEN",
    "build_tokenizer",
    "build_tiny_checkpoint",
    "cached_checkpoint",
    "default_cache_root",
    "llama3_rope_scaling",
    "longrope_scaling",
    "logit_margins",
]

#: Bump when the builder's output changes, so cached checkpoints are rebuilt.
BUILDER_VERSION = 1

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3")
#: Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration): the gemma3_text model with a tiny
#: vision tower, saved as transformers saves it (language_model.model.*). Not among MODEL_TYPES
#: (a text-only loader reads other tensor names); build_config / build_tiny_checkpoint take it.
MULTIMODAL_GEMMA3 = "gemma3"

DEFAULT_INITIALIZER_RANGE = 0.2


#: The benchmark model of bench/ ("smollm-135m-shape", defined in bench/README.md): 124.6 M parameters.
#: Initialized as plain HF does (LlamaConfig's default range 0.02, norms at 1), as bench/README.md
#: builds it; speed does not depend on it, and a 30-layer model stays well-scaled with it.
SMOLLM_135M_SHAPE: dict[str, Any] = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    initializer_range=0.02,
    perturb_norms_and_biases=False,
    dtype=torch.float32,
    seed=0,
)

#: Qwen3-0.6B's shape (random weights) for the GPU benchmarks (bench/gpu_throughput.py).
QWEN3_06B_SHAPE: dict[str, Any] = dict(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    initializer_range=0.02,
    perturb_norms_and_biases=False,
    dtype=torch.bfloat16,
    seed=0,
)

#: Small named shapes for tests (pass to build_tiny_checkpoint / cached_checkpoint).
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama"),
    "tiny-llama-tied": dict(model_type="llama", tie_word_embeddings=True),
    "tiny-mistral": dict(model_type="mistral"),
    "tiny-qwen2": dict(model_type="qwen2"),
    "tiny-qwen3": dict(model_type="qwen3"),
    "tiny-gemma2": dict(model_type="gemma2"),
    "tiny-gemma3": dict(model_type="gemma3_text"),
    "tiny-phi3": dict(model_type="phi3"),
    "tiny-smollm3": dict(model_type="smollm3"),
}

# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------

#: Built-in training corpus: original English paragraphs, some code and numbers, and
#: multi-byte UTF-8 (Chinese, accented Latin, Greek, Cyrillic, emoji) so that byte-level
#: merges across multi-byte characters exist.
def llama3_rope_scaling(
    factor: float = 8.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 256,
) -> dict[str, Any]:
    """A ``rope_scaling`` argument for ``build_tiny_checkpoint`` selecting Llama 3.1's
    frequency-dependent RoPE scaling. (``original_max_position_embeddings`` must be less
    than the model's ``max_position_embeddings``.)"""
    return {
        "rope_type": "llama3",
        "factor": float(factor),
        "low_freq_factor": float(low_freq_factor),
        "high_freq_factor": float(high_freq_factor),
        "original_max_position_embeddings": int(original_max_position_embeddings),
    }


def longrope_scaling(rotary_dim: int, short_scale: float = 0.05, long_scale: float = 0.5) -> dict[str, Any]:
    """A ``rope_scaling`` argument for a ``phi3`` ``build_tiny_checkpoint`` selecting LongRoPE (Phi-3's
    "su" scaling): per frequency, short factors 1 + short_scale * i and long factors
    1 + long_scale * i, i = 0 .. rotary_dim / 2 - 1 (``rotary_dim``: head_dim x
    partial_rotary_factor). The switch point is the checkpoint's
    ``original_max_position_embeddings`` (a keyword of its own)."""
    n = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + short_scale * i for i in range(n)],
        "long_factor": [1.0 + long_scale * i for i in range(n)],
    }


def _to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
    }
    key = str(dtype).removeprefix("torch.")
    if key not in names:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(set(names))}")
    return names[key]


def build_config(
    model_type: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    initializer_range: float = DEFAULT_INITIALIZER_RANGE,
    rms_norm_eps: float = 1e-6,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    dtype: torch.dtype | str = torch.float32,
    sliding_window: int | None = None,
    layer_types: list[str] | None = None,
    max_window_layers: int | None = None,
    query_pre_attn_scalar: float | None = None,
    attn_logit_softcapping: float | None = None,
    final_logit_softcapping: float | None = None,
    rope_local_theta: float = 10000.0,
    partial_rotary_factor: float = 1.0,
    original_max_position_embeddings: int | None = None,
    no_rope_layer_interval: int | None = None,
    attention_bias: bool = False,
    mlp_bias: bool = False,
):
    """The Hugging Face config (``LlamaConfig``, ``MistralConfig``, ``Qwen2Config``,
    ``Qwen3Config``, ``Gemma2Config``, ``Gemma3TextConfig``, ``Phi3Config``, ``SmolLM3Config``)
    that ``build_tiny_checkpoint`` uses, without building weights. (E.g. ``with
    torch.device("meta"): AutoModelForCausalLM.from_config(cfg)`` to count parameters.)

    Family keywords (None: the family's usual form):

    - ``sliding_window``: mistral and phi3: every layer; qwen2/qwen3: the layers from
      ``max_window_layers`` on (transformers' default 28), with ``use_sliding_window``; smollm3:
      the layers without RoPE, with ``use_sliding_window``; gemma2/gemma3_text: the sliding
      layers (default window 32). ``layer_types`` ("sliding_attention" / "full_attention" per layer) overrides
      the pattern (gemma2: alternating from a sliding layer 0; gemma3_text: every second layer,
      transformers' sliding_window_pattern = 2 here).
    - gemma2/gemma3_text: ``query_pre_attn_scalar`` (default: head_dim), soft-capping of the
      attention scores and of the final logits (gemma2 default 50.0 / 30.0, gemma3_text none);
      gemma3_text: ``rope_local_theta`` (the sliding layers' RoPE base), ``rope_theta`` and
      ``rope_scaling`` the full-attention layers'.
    - phi3: ``partial_rotary_factor``, ``original_max_position_embeddings`` (LongRoPE's switch
      point; default max_position_embeddings), ``rope_scaling`` e.g. ``longrope_scaling(...)``.
    - smollm3: ``no_rope_layer_interval`` (every n-th layer skips RoPE; default 2 here).
    - ``attention_bias``: llama/smollm3/gemma: q/k/v/o biases (qwen2 always has q/k/v ones);
      ``mlp_bias``: llama/smollm3: gate/up/down biases."""
    import transformers

    if model_type == MULTIMODAL_GEMMA3:
        args = dict(locals(), model_type="gemma3_text")
        del args["transformers"]
        return _gemma3_multimodal(build_config(**args), tie_word_embeddings)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; use one of {MODEL_TYPES} "
                         f"(or {MULTIMODAL_GEMMA3!r})")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
        )
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(rope_theta)}
    if rope_scaling is not None:
        rope_parameters = dict(rope_scaling)
        if "type" in rope_parameters and "rope_type" not in rope_parameters:
            rope_parameters["rope_type"] = rope_parameters.pop("type")
        rope_parameters["rope_theta"] = float(rope_theta)
        if rope_parameters.get("rope_type") == "llama3":
            omax = rope_parameters.get("original_max_position_embeddings")
            if omax is None or omax >= max_position_embeddings:
                raise ValueError(
                    "llama3 rope scaling needs original_max_position_embeddings < "
                    f"max_position_embeddings={max_position_embeddings}, got {omax}"
                )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters=rope_parameters,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        attention_dropout=0.0,
        dtype=_to_dtype(dtype),
    )
    default_head_dim = hidden_size // num_heads
    windowed = dict(use_sliding_window=sliding_window is not None, sliding_window=sliding_window)
    if layer_types is not None:
        windowed["layer_types"] = list(layer_types)
    qwen_window_layers = {} if max_window_layers is None else {"max_window_layers": max_window_layers}
    if model_type == "llama":
        cfg = transformers.LlamaConfig(
            **common, head_dim=head_dim, attention_bias=attention_bias, mlp_bias=mlp_bias
        )
    elif model_type == "mistral":
        cfg = transformers.MistralConfig(**common, head_dim=head_dim, sliding_window=sliding_window)
    elif model_type in ("qwen2", "phi3"):
        # Qwen2 and Phi-3 have no head_dim field: it is always hidden_size // num_attention_heads.
        if head_dim is not None and head_dim != default_head_dim:
            raise ValueError(
                f"{model_type} does not support head_dim={head_dim} != hidden_size // num_heads "
                f"= {default_head_dim}"
            )
        if model_type == "qwen2":
            cfg = transformers.Qwen2Config(**common, **windowed, **qwen_window_layers)
        else:
            rope = dict(common.pop("rope_parameters"))
            rope["partial_rotary_factor"] = float(partial_rotary_factor)
            omax = original_max_position_embeddings or max_position_embeddings
            if rope.get("rope_type") == "longrope" and omax >= max_position_embeddings:
                raise ValueError(f"longrope needs original_max_position_embeddings < max_position_embeddings="
                                 f"{max_position_embeddings}, got {omax}")
            cfg = transformers.Phi3Config(**common, rope_parameters=rope, original_max_position_embeddings=omax,
                                          sliding_window=sliding_window)
    elif model_type == "qwen3":
        cfg = transformers.Qwen3Config(
            **common,
            head_dim=head_dim if head_dim is not None else default_head_dim,
            attention_bias=False,
            **windowed,
            **qwen_window_layers,
        )
    elif model_type == "smollm3":
        cfg = transformers.SmolLM3Config(**common, **windowed, no_rope_layer_interval=no_rope_layer_interval or 2,
                                         attention_bias=attention_bias, mlp_bias=mlp_bias)
    else:  # gemma2, gemma3_text
        common.pop("hidden_act")
        rope = common.pop("rope_parameters")
        hd = head_dim if head_dim is not None else default_head_dim
        gemma = dict(
            head_dim=hd, hidden_activation="gelu_pytorch_tanh", attention_bias=attention_bias,
            sliding_window=sliding_window if sliding_window is not None else 32,
            query_pre_attn_scalar=query_pre_attn_scalar if query_pre_attn_scalar is not None else hd,
        )
        if layer_types is not None:
            gemma["layer_types"] = list(layer_types)
        if model_type == "gemma2":
            cfg = transformers.Gemma2Config(
                **common, **gemma, rope_parameters=rope,
                attn_logit_softcapping=50.0 if attn_logit_softcapping is None else attn_logit_softcapping,
                final_logit_softcapping=30.0 if final_logit_softcapping is None else final_logit_softcapping)
        else:
            if "layer_types" not in gemma:
                gemma["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                        for i in range(num_layers)]
            local = {"rope_type": "default", "rope_theta": float(rope_local_theta)}
            cfg = transformers.Gemma3TextConfig(
                **common, **gemma, rope_parameters={"full_attention": rope, "sliding_attention": local},
                attn_logit_softcapping=attn_logit_softcapping, final_logit_softcapping=final_logit_softcapping)
    if getattr(cfg, "head_dim", default_head_dim) % 2 != 0:
        raise ValueError(f"head_dim={cfg.head_dim} must be even for RoPE")
    return cfg


def _gemma3_multimodal(text_config, tie_word_embeddings: bool):
    """A multimodal Gemma 3 config ("gemma3", Gemma3ForConditionalGeneration) around `text_config`,
    with a one-layer SigLIP vision tower (which pyengine does not load)."""
    import transformers

    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Gemma3Config(text_config=text_config, vision_config=vision, mm_tokens_per_image=4,
                                     tie_word_embeddings=tie_word_embeddings, dtype=text_config.dtype)


@torch.no_grad()
def _perturb_norms_and_biases(model: torch.nn.Module, std: float = 0.1) -> None:
    """Give RMSNorm weights values around 1 and biases non-zero values, so that a loader
    or kernel that ignores them cannot match the reference by accident. Runs under the
    caller's seed (deterministic)."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or "_norm" in name:
            param.add_(torch.randn_like(param) * std)
        elif name.endswith(".bias"):
            param.copy_(torch.randn_like(param) * std)


def _save_quietly(model, path: Path, save_kwargs: dict[str, Any]) -> None:
    """save_pretrained without the shard-writing progress bar."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(path), **save_kwargs)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def build_tiny_checkpoint(
    path: Path | str,
    model_type: str = "llama",
    *,
    vocab_size: int = 512,
    perturb_norms_and_biases: bool = True,
    dtype: torch.dtype | str = torch.float32,
    seed: int = 0,
    sharded: bool = False,
    max_shard_size: int | str | None = None,
    with_tokenizer: bool = True,
    tokenizer_vocab_size: int | None = None,
    **config: Any,
) -> Path:
    """Build a random-weight ``model_type`` checkpoint (one of ``MODEL_TYPES``) into
    ``path`` and return ``path``. ``config``: the shape and the rest of :func:`build_config`'s
    keywords (hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
    tie_word_embeddings, max_position_embeddings, rope_theta, rope_scaling,
    initializer_range, rms_norm_eps, and the family keywords: sliding_window, layer_types, ...).

    The Hugging Face ``*ForCausalLM`` is instantiated under ``torch.manual_seed(seed)``
    (deterministic for a given torch version), cast to ``dtype`` and written with
    ``save_pretrained(path, safe_serialization=True)``. ``sharded=True`` writes several
    ``model-0000x-of-0000y.safetensors`` shards and ``model.safetensors.index.json``
    (shard size ``max_shard_size``, by default a quarter of the model). ``rope_scaling``
    takes e.g. ``llama3_rope_scaling(...)``; it lands in config.json's
    ``rope_parameters`` together with ``rope_theta``. With ``with_tokenizer`` the tiny BPE
    tokenizer is saved too (vocabulary ``tokenizer_vocab_size``, by default
    ``min(vocab_size, 512)``; it may be smaller than the model's), and config's
    ``bos_token_id``/``eos_token_id`` are the tokenizer's (1 and 2).
    """
    import transformers

    path = Path(path)
    dtype = _to_dtype(dtype)
    tokenizer = None
    if with_tokenizer:
        tv = tokenizer_vocab_size if tokenizer_vocab_size is not None else min(vocab_size, 512)
        if tv > vocab_size:
            raise ValueError(
                f"tokenizer_vocab_size={tv} is larger than the model's vocab_size={vocab_size}"
            )
        tokenizer = build_tokenizer(None, vocab_size=tv)
        bos_id, eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    else:
        bos_id, eos_id = SPECIAL_TOKENS.index(BOS_TOKEN), SPECIAL_TOKENS.index(EOS_TOKEN)
    hf_config = build_config(model_type, vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id,
                             dtype=dtype, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if perturb_norms_and_biases:
        _perturb_norms_and_biases(model)
    model = model.to(dtype).eval()
    model.config.dtype = dtype

    path.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if sharded:
        if max_shard_size is None:
            nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
            max_shard_size = max(nbytes // 4, 1024)
        save_kwargs["max_shard_size"] = max_shard_size
    _save_quietly(model, path, save_kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def build_truncated_checkpoint(source: Path | str, path: Path | str, num_layers: int) -> Path:
    """The first ``num_layers`` decoder layers of the checkpoint in ``source`` (with its
    embedding, final norm, output head and tokenizer) saved into ``path``: a draft model for
    speculative decoding that shares the model's vocabulary and agrees with it in part, as a
    layer-skipping draft does. Returns ``path``."""
    import transformers
    from transformers.utils import logging as hf_logging

    source, path = Path(source), Path(path)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype="auto")
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    total = model.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    path.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, path, {"safe_serialization": True})
    if any((source / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        transformers.AutoTokenizer.from_pretrained(str(source)).save_pretrained(str(path))
    return path


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------

_STAMP = ".pyengine-checkpoint.json"


def default_cache_root() -> Path:
    """``$PYENGINE_CHECKPOINT_CACHE`` if set, else ``~/.cache/pyengine/checkpoints``."""
    env = os.environ.get("PYENGINE_CHECKPOINT_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "pyengine" / "checkpoints"


def _stamp_for(builder_kwargs: dict[str, Any], builder: Callable[..., Path] | None = None) -> dict[str, Any]:
    import tokenizers
    import transformers

    def norm(v: Any) -> Any:
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in sorted(v.items())}
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if isinstance(v, Path):
            return str(v)
        return v

    kwargs = norm(dict(builder_kwargs))
    if "dtype" in builder_kwargs:
        kwargs["dtype"] = str(_to_dtype(builder_kwargs["dtype"]))
    stamp = {
        "builder_version": BUILDER_VERSION,
        "kwargs": kwargs,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    if builder is not None and builder is not build_tiny_checkpoint:  # (build_tiny_checkpoint's stamps name none)
        stamp["builder"] = f"{builder.__module__}.{builder.__qualname__}"
    return stamp


def _read_stamp(d: Path) -> dict[str, Any] | None:
    try:
        return json.loads((d / _STAMP).read_text())
    except (OSError, ValueError):
        return None


def is_cached(name: str, builder_kwargs: dict[str, Any] | None = None, root: Path | str | None = None,
              builder: Callable[..., Path] | None = None) -> bool:
    """True when ``cached_checkpoint(name, builder_kwargs, root, builder)`` would reuse a built
    checkpoint."""
    root = Path(root) if root is not None else default_cache_root()
    return _read_stamp(root / name) == _stamp_for(dict(builder_kwargs or {}), builder)


def cached_checkpoint(
    name: str, builder_kwargs: dict[str, Any] | None = None, root: Path | str | None = None,
    builder: Callable[..., Path] | None = None,
) -> Path:
    """Return ``<root>/<name>`` (root: ``default_cache_root()``), building it with
    ``builder(path, **builder_kwargs)`` (default ``build_tiny_checkpoint``) if it is missing or
    was built by another builder, from other arguments or library versions (recorded in a
    stamp file inside it).

    The checkpoint is built in a temporary directory beside it and renamed into place,
    so a half-written checkpoint is never reused; concurrent callers (e.g. test workers)
    may both build, and the first rename wins.
    """
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid checkpoint name {name!r}")
    builder_kwargs = dict(builder_kwargs or {})
    if "path" in builder_kwargs:
        raise ValueError("builder_kwargs must not contain 'path'")
    root = Path(root) if root is not None else default_cache_root()
    final = root / name
    stamp = _stamp_for(builder_kwargs, builder)
    if _read_stamp(final) == stamp:
        return final

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
    try:
        (builder or build_tiny_checkpoint)(tmp, **builder_kwargs)
        # The stamp is written last: a directory with a valid stamp is complete.
        (tmp / _STAMP).write_text(json.dumps(stamp, indent=1, sort_keys=True))
        if final.exists():
            if _read_stamp(final) == stamp:  # another process finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            stale = root / f".{name}.stale-{uuid.uuid4().hex}"
            try:
                os.rename(final, stale)
            except FileNotFoundError:
                pass
            else:
                shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost a race: someone else put a checkpoint in place meanwhile.
            shutil.rmtree(tmp, ignore_errors=True)
            if _read_stamp(final) != stamp:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# --------------------------------------------------------------------------------------
# Margins (how the default initializer range was chosen)
# --------------------------------------------------------------------------------------


@torch.no_grad()
def logit_margins(
    model_dir: Path | str,
    *,
    num_prompts: int = 8,
    prompt_len: int = 16,
    new_tokens: int = 32,
    seed: int = 0,
) -> dict[str, float]:
    """Greedy-generate from random prompts with Hugging Face and measure, over the
    generated positions, the gap between the two largest logits.

    Returns the median absolute gap, the median gap relative to the largest absolute
    logit (``median_rel_gap``), the fraction of positions whose relative gap is below
    1e-3 (``frac_rel_gap_lt_1e-3``), and the fraction of distinct generated tokens
    (``distinct_frac``; near 0 means a degenerate model that repeats one token).
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32
    ).eval()
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(4, vocab, (num_prompts, prompt_len), generator=g)
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    scores = torch.stack(out.scores, dim=1).float()  # [B, T, V]
    top2 = scores.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]
    scale = scores.abs().amax(dim=-1)
    rel = gap / scale
    gen = out.sequences[:, prompt_len:]
    distinct = sum(len(set(row.tolist())) for row in gen) / gen.numel()
    return {
        "median_gap": gap.median().item(),
        "median_rel_gap": rel.median().item(),
        "min_rel_gap": rel.min().item(),
        "frac_rel_gap_lt_1e-3": (rel < 1e-3).float().mean().item(),
        "logit_std": scores.std(dim=-1).mean().item(),
        "distinct_frac": distinct,
    }


def checkpoint_digest(path: Path | str) -> str:
    """sha256 over the checkpoint's files (names and bytes), stamp excluded."""
    h = hashlib.sha256()
    path = Path(path)
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != _STAMP):
        h.update(str(f.relative_to(path)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()
