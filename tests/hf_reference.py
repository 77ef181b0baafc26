"""Hugging Face transformers as the correctness reference."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig


@lru_cache(maxsize=8)
def hf_model(model_dir: str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32,
              stop_at_eos: bool = False, device: str = "cpu") -> list[int]:
    """Greedy continuation by transformers' generate (one prompt, no padding)."""
    model = hf_model(str(model_dir), dtype, device)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                           eos_token_id=model.config.eos_token_id if stop_at_eos else None)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                             generation_config=cfg)
    return out[0, len(prompt):].tolist()


def hf_topk_agrees(model_dir: Path, prompt: list[int], generated: list[int], dtype: torch.dtype, k: int,
                   device: str = "cpu") -> list[int]:
    """Positions where `generated` (teacher-forced) is NOT among transformers' top-k tokens."""
    model = hf_model(str(model_dir), dtype, device)
    ids = torch.tensor([prompt + generated], device=device)
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    topk = logits.topk(k, dim=-1).indices
    return [i for i, t in enumerate(generated) if t not in topk[i].tolist()]
