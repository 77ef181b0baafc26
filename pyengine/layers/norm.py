"""RMSNorm as transformers computes it (in fp32, the result cast back, then scaled), and the
residual add before it; on the CPU, small batches use the fused kernels of
``pyengine.layers.elementwise``, which round the same way."""

from __future__ import annotations

import torch

from pyengine.layers import elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)) as transformers' residual add and the next norm; the
    fused kernel adds into h in place (h must be the forward's own residual stream)."""
    if fused:
        if delta is None:
            return h, elementwise.rms_norm(h, weight, eps)
        return h, elementwise.add_rms_norm(delta, h, weight, eps)
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma RMSNorm: ``(x.float() * rsqrt(mean(x.float()**2) + eps) * (1 + w.float())).to(x.dtype)``
    -- scaled in fp32, then rounded once (Llama's rounds, then scales). `weight_plus_one` is
    ``1.0 + w.float()``, fp32, computed once at load."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight_plus_one).to(dtype)
