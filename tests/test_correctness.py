"""Greedy outputs equal Hugging Face transformers' for every supported architecture, and do
not depend on batching, chunking, pool size or preemption."""

from __future__ import annotations

import random

import pytest
import torch

from hf_reference import hf_greedy, hf_topk_agrees
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
from pyengine.testing.checkpoints import llama3_rope_scaling

PROMPT_LENGTHS = (1, 7, 16, 33, 64, 120, 211, 300)
NEW_TOKENS = 32

VARIANTS = {
    "llama_mha": dict(model_type="llama", num_heads=4, num_kv_heads=4),
    "llama_gqa": dict(model_type="llama", num_heads=4, num_kv_heads=2),
    "llama_mqa": dict(model_type="llama", num_heads=4, num_kv_heads=1),
    "llama_tied_llama3_rope": dict(model_type="llama", num_heads=4, num_kv_heads=2, tie_word_embeddings=True,
                                   rope_scaling=llama3_rope_scaling(original_max_position_embeddings=64)),
    "llama_sharded": dict(model_type="llama", num_heads=4, num_kv_heads=2, sharded=True),
    "mistral": dict(model_type="mistral", num_heads=4, num_kv_heads=2),
    "qwen2": dict(model_type="qwen2", num_heads=4, num_kv_heads=2),
    "qwen2_tied": dict(model_type="qwen2", num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_heads=4, num_kv_heads=2, head_dim=32),
}


def make_prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def run_engine(model_dir, prompts, dtype="float32", *, max_batch_size=8, max_num_tokens=512,
               tokens_per_block=16, max_tokens=8192, chunked=True, policy="guaranteed_no_evict",
               new_tokens=NEW_TOKENS, max_seq_len=340):
    engine = Engine(model_dir, dtype=dtype, max_seq_len=max_seq_len,
                    kv_cache_config=KvCacheConfig(tokens_per_block=tokens_per_block, max_tokens=max_tokens),
                    scheduler_config=SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                                     enable_chunked_prefill=chunked,
                                                     capacity_scheduler_policy=policy))
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    return engine, results


@pytest.fixture(scope="module")
def references(checkpoint_factory):
    cache = {}

    def get(variant: str):
        if variant not in cache:
            model_dir = checkpoint_factory(variant, **VARIANTS[variant])
            cache[variant] = (model_dir, [hf_greedy(model_dir, p, NEW_TOKENS) for p in make_prompts()])
        return cache[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_greedy_equals_transformers(variant, references):
    model_dir, expected = references(variant)
    _, results = run_engine(model_dir, make_prompts())
    for prompt, r, ref in zip(make_prompts(), results, expected):
        assert len(r.token_ids) == NEW_TOKENS
        assert r.token_ids == ref, f"prompt of {len(prompt)} tokens diverges"
        assert r.finish_reason == "length"


@pytest.mark.parametrize("bf16_matmul", ["native", "fp32"])
@pytest.mark.parametrize("variant", ["llama_gqa", "qwen3"])
def test_bf16_greedy_is_close_to_transformers(variant, checkpoint_factory, monkeypatch, bf16_matmul):
    """bf16 rounding differs between implementations: each token we pick must be among
    transformers' top-3 given the same prefix (vLLM's check_logprobs_close idea), and most
    sequences must match exactly. Both bf16 matmul paths: torch's bf16 GEMM, and, as on CPUs
    without bf16 instructions, fp32 GEMMs on bf16 values for batches of 16+ rows and
    pyengine's bf16 kernel (fp32 accumulation) for fewer rows (decode)."""
    monkeypatch.setenv("PYENGINE_BF16_MATMUL", bf16_matmul)
    model_dir = checkpoint_factory(variant, **VARIANTS[variant])
    prompts = make_prompts()
    engine, results = run_engine(model_dir, prompts, dtype="bfloat16")
    assert engine._runner.model.emulate_bf16 == (bf16_matmul == "fp32")
    exact = 0
    for p, r in zip(prompts, results):
        assert hf_topk_agrees(model_dir, p, r.token_ids, torch.bfloat16, k=3) == []
        exact += r.token_ids == hf_greedy(model_dir, p, NEW_TOKENS, torch.bfloat16)
    assert exact >= len(prompts) // 2


@pytest.mark.parametrize("setup", [
    dict(max_num_tokens=32, tokens_per_block=8),                 # prompts span up to 10 chunks
    dict(max_batch_size=1),                                      # one request at a time
    dict(max_batch_size=3, max_num_tokens=64, tokens_per_block=4),
    dict(chunked=False, max_num_tokens=512),                     # whole prompts
    dict(max_tokens=400, tokens_per_block=16),                   # no-evict: requests wait for blocks
    dict(max_tokens=400, policy="max_utilization"),              # pause and recompute
    dict(max_tokens=400, policy="max_utilization", chunked=False),
    dict(max_tokens=1024, policy="static_batch", max_batch_size=4),
])
def test_output_does_not_depend_on_scheduling(setup, references):
    model_dir, expected = references("llama_gqa")
    engine, results = run_engine(model_dir, make_prompts(), **setup)
    assert [r.token_ids for r in results] == expected
    if setup.get("policy") == "max_utilization":
        assert sum(r.metrics.num_pauses for r in results) > 0, "the pool was meant to force pauses"


def test_requests_wait_for_blocks_under_no_evict(references):
    """With a pool for ~one long request, later requests start only as earlier ones finish."""
    model_dir, expected = references("llama_gqa")
    engine, results = run_engine(model_dir, make_prompts(), max_tokens=400)
    assert [r.token_ids for r in results] == expected
    firsts = sorted(r.metrics.first_scheduled_time for r in results)
    finishes = sorted(r.metrics.finish_time for r in results)
    # at least one request was scheduled only after another had finished
    assert firsts[-1] > finishes[0]
    assert all(r.metrics.num_pauses == 0 for r in results)


def test_output_does_not_depend_on_batch_companions(references):
    model_dir, expected = references("llama_gqa")
    prompts = make_prompts()
    _, alone = run_engine(model_dir, [prompts[5]])
    _, shuffled = run_engine(model_dir, prompts[::-1])
    assert alone[0].token_ids == expected[5]
    assert [r.token_ids for r in shuffled] == expected[::-1]
