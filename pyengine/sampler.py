"""Turns logits rows into tokens. Greedy decoding only for now (see SamplingParams)."""

from __future__ import annotations

import torch


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] -> int32 tokens [n]; ties go to the lowest id, as in transformers."""
    return torch.argmax(logits, dim=-1).to(torch.int32)
