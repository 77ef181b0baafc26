"""Sampling: SamplingParams (what a request asks for) and the Sampler (logits -> tokens, with
per-sequence-slot state)."""

from pyengine.sampling.params import SamplingParams
from pyengine.sampling.sampler import SampleResult, Sampler

__all__ = ["SamplingParams", "Sampler", "SampleResult"]
