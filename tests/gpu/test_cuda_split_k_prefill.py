"""Engines whose prefill goes through the split-K attention kernel -- float32, and head_dim 256 --
start and generate with contexts past one split (256 tokens) and prefill batches of far more
tokens than max_batch_size. Their split-K workspace is sized for max_num_tokens rows; sized for
max_batch_size rows, the KV-capacity estimate's dummy batch (a max_num_tokens prefill) was
refused and the engine died at start-up. Skipped without a CUDA device (tests/gpu/conftest.py)."""

from __future__ import annotations

import math

import torch

from hf_reference import hf_greedy, hf_topk_agrees
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

NEW_TOKENS = 24
PROMPT_LENGTHS = (700, 450, 3)  # 700: two prefill chunks of a 512-token budget


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def long_prefill_engine(model_dir, dtype: str) -> Engine:
    # KV capacity estimated (free_memory_fraction's default): the dummy batch runs at start-up
    return Engine(model_dir, dtype=dtype, device="cuda", max_seq_len=1024, seed=0,
                  kv_cache_config=KvCacheConfig(max_tokens=8192),
                  scheduler_config=SchedulerConfig(max_batch_size=2, max_num_tokens=512))


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_fp32_engine_with_long_prefill_equals_transformers(checkpoint_factory):
    model_dir = checkpoint_factory("gpu_split_k_fp32", model_type="llama", hidden_size=256, num_heads=4,
                                   num_kv_heads=2)
    engine = long_prefill_engine(model_dir, "float32")
    assert engine.startup_report()["kv_capacity"]["source"] == "estimated"
    results = engine.generate(prompts(), greedy(), use_tqdm=False)
    for p, r in zip(prompts(), results):
        assert r.token_ids == hf_greedy(model_dir, p, NEW_TOKENS, device="cuda"), f"prompt of {len(p)} tokens"


def test_head_dim_256_engine_with_long_prefill_stays_close(checkpoint_factory):
    model_dir = checkpoint_factory("gpu_split_k_hd256", model_type="qwen3", hidden_size=256, num_heads=4,
                                   num_kv_heads=2, head_dim=256)
    engine = long_prefill_engine(model_dir, "bfloat16")
    results = engine.generate(prompts(), greedy(), use_tqdm=False)
    assert all(len(r.token_ids) == NEW_TOKENS for r in results)
    misses = sum(len(hf_topk_agrees(model_dir, p, r.token_ids, torch.bfloat16, k=5, device="cuda"))
                 for p, r in zip(prompts(), results))
    assert misses <= math.ceil(0.1 * NEW_TOKENS * len(PROMPT_LENGTHS)), misses
