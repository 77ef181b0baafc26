"""Rotary position embedding (RoPE) as transformers applies it: the inverse frequencies (with
Llama 3 frequency scaling), the cos/sin tables, and the rotation; on the CPU, small batches use
the fused in-place kernel of ``pyengine.layers.elementwise``, bit-exact with the torch form."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from pyengine.layers import elementwise

if TYPE_CHECKING:
    from pyengine.models.config import ModelConfig


def rope_inv_freq(config: "ModelConfig") -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if "freq_factors" in s:
        # The same scaling as llama.cpp stores it in a GGUF file (rope_freqs.weight): each frequency
        # divided by its factor (equal to the form below up to float rounding).
        return inv_freq / torch.tensor(s["freq_factors"], dtype=torch.float32)
    # Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s.get("original_max_position_embeddings", config.max_position_embeddings))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(config: "ModelConfig", max_seq_len: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_seq_len, head_dim] in `dtype`, computed in fp32 as transformers does."""
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = positions[:, None] * rope_inv_freq(config)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, heads, head_dim] rotated to their positions. `fused`: the CPU kernel, in place on
    the full tables; otherwise `cos`/`sin` are the rows of the batch's positions, [T, 1, D]."""
    if fused:
        elementwise.rotary_embedding_(q, cos, sin, positions)
        elementwise.rotary_embedding_(k, cos, sin, positions)
        return q, k
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
