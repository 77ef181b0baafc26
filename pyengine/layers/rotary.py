"""Rotary position embedding (RoPE) as transformers applies it: the inverse frequencies (default,
linear, Llama 3 and LongRoPE scaling), the cos/sin tables, and the rotation (of the whole head, or
of its leading part: partial_rotary_factor); on the CPU, small batches use the fused in-place kernel
of ``pyengine.layers.elementwise``, bit-exact with the torch form."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from pyengine.layers import elementwise

if TYPE_CHECKING:
    from pyengine.models.config import ModelConfig


def inv_freq_for(theta: float, scaling: dict[str, Any] | None, dim: int, max_position_embeddings: int,
                 *, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim // 2] in fp32, attention factor) of one RoPE, computed as transformers'
    ``ROPE_INIT_FUNCTIONS`` do: `dim` rotated dimensions, base `theta`, `scaling` a ModelConfig's
    rope_scaling (None: plain RoPE). LongRoPE: the short factors, or with `long` the long ones; its
    attention factor scales cos and sin (1.0 for every other type)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    kind = None if scaling is None else scaling.get("rope_type")
    if scaling is not None and "freq_factors" in scaling:
        # The same scaling as llama.cpp stores it in a GGUF file (rope_freqs.weight): each frequency
        # divided by its factor (equal to the Llama 3 form below up to float rounding).
        inv_freq = 1.0 / (theta ** exponents)
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32), 1.0
    if kind == "longrope":
        omax = int(scaling["original_max_position_embeddings"])
        factor = scaling.get("factor")
        if factor is None:  # Phi-3: the ratio of the context lengths
            factor = max_position_embeddings / omax
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omax))
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** exponents), float(attention_factor)
    inv_freq = 1.0 / (theta ** exponents)
    if kind is None or kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r}")
    # Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between.
    s = scaling
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s.get("original_max_position_embeddings", max_position_embeddings))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def rope_inv_freq(config: "ModelConfig") -> torch.Tensor:
    """The inverse frequencies of the model's (full-attention layers') RoPE."""
    return inv_freq_for(config.rope_theta, config.rope_scaling, config.rotary_dim, config.max_position_embeddings)[0]


def cos_sin_tables(inv_freq: torch.Tensor, attention_factor: float, max_seq_len: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_seq_len, 2 * len(inv_freq)] in `dtype`, computed in fp32 as transformers'
    rotary embeddings do (scaled by the attention factor, then cast)."""
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype).to(device), sin.to(dtype).to(device)


def rope_tables(config: "ModelConfig", max_seq_len: int, dtype: torch.dtype, device: torch.device, *,
                sliding: bool = False, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_seq_len, rotary_dim] in `dtype`, of the model's RoPE: the full-attention
    layers', or with `sliding` the sliding-window layers' where they differ (Gemma 3); LongRoPE's
    short factors, or with `long` its long ones."""
    theta, scaling = config.rope_theta, config.rope_scaling
    if sliding and config.sliding_rope_theta is not None:
        theta, scaling = config.sliding_rope_theta, config.sliding_rope_scaling
    inv_freq, attention_factor = inv_freq_for(theta, scaling, config.rotary_dim, config.max_position_embeddings,
                                              long=long)
    return cos_sin_tables(inv_freq, attention_factor, max_seq_len, dtype, device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, heads, head_dim] rotated to their positions. `fused`: the CPU kernel, in place on
    the full tables; otherwise `cos`/`sin` are the rows of the batch's positions, [T, 1, D].
    A table narrower than the heads rotates their leading dimensions only (partial_rotary_factor),
    as transformers' Phi-3 does: the rest passes through."""
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        assert not fused, "the fused rotary kernel rotates whole heads"
        q_rot, k_rot = q[..., :rot], k[..., :rot]
        return (torch.cat([q_rot * cos + rotate_half(q_rot) * sin, q[..., rot:]], dim=-1),
                torch.cat([k_rot * cos + rotate_half(k_rot) * sin, k[..., rot:]], dim=-1))
    if fused:
        elementwise.rotary_embedding_(q, cos, sin, positions)
        elementwise.rotary_embedding_(k, cos, sin, positions)
        return q, k
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
