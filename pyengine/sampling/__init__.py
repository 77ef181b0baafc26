"""Sampling: SamplingParams (what a request asks for) and the Sampler (logits -> tokens, with
per-sequence-slot state)."""

from pyengine.sampling.guided import GuidedDecodingParams
from pyengine.sampling.params import SamplingParams
from pyengine.sampling.sampler import DraftRows, SampleResult, Sampler, drafts_allowed

__all__ = ["DraftRows", "GuidedDecodingParams", "SamplingParams", "Sampler", "SampleResult", "drafts_allowed"]
