"""Helpers shared by the speculative-decoding tests (tests/test_speculative*.py)."""

from __future__ import annotations

import random

from pyengine import Engine, SamplingParams

PROMPT_LENGTHS = (5, 9, 17, 30, 41, 64)
NEW_TOKENS = 48


def make_prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def seeded_params() -> list[SamplingParams]:
    """Six seeded requests at low temperatures (the copying model's logits are small: low
    temperatures keep its habit of repeating itself, so that drafts get accepted)."""
    return [SamplingParams(temperature=t, top_p=p, top_k=k, seed=10 + i, max_tokens=40, ignore_eos=True)
            for i, (t, p, k) in enumerate([(0.005, 1.0, -1), (0.01, 0.9, -1), (0.02, 1.0, 20), (0.01, 0.8, 5),
                                           (0.05, 1.0, -1), (0.3, 0.95, -1)])]


def generate(engine: Engine, prompts, params) -> list:
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine.check_resources()
    return outs


def total_variation(a, b) -> float:
    """Total variation distance between the empirical distributions of two token samples
    (1-D integer tensors); asserts that `a` is no point mass (the comparison would say nothing)."""
    import torch

    assert len(set(a.tolist())) > 5, "the distribution is not a point mass"
    vocab = int(max(a.max(), b.max())) + 1
    pa, pb = (torch.bincount(x, minlength=vocab).double() / len(x) for x in (a, b))
    return 0.5 * float((pa - pb).abs().sum())
