"""The engine on a GPU: greedy outputs equal transformers' on the same GPU, CUDA graphs and the
overlap loop change no output, KV capacity comes from torch.cuda's figures, a failed step
changes nothing, fp8 KV stays close. Skipped without a CUDA device (tests/gpu/conftest.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_reference import MAX_FLIP_FRACTION, hf_greedy, hf_topk_agrees, near_tie_check
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

NEW_TOKENS = 32
PROMPT_LENGTHS = (1, 7, 16, 33, 64, 120, 211, 300)

# head_dim 64 or 128: the sizes the CUDA kernels are built for.
GPU_VARIANTS = {
    "llama_gqa": dict(model_type="llama", hidden_size=256, num_heads=4, num_kv_heads=2),
    "llama_mqa": dict(model_type="llama", hidden_size=256, num_heads=4, num_kv_heads=1),
    "llama_mha_tied": dict(model_type="llama", hidden_size=256, num_heads=4, num_kv_heads=4,
                           tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=256, num_heads=4, num_kv_heads=2),
    "qwen3": dict(model_type="qwen3", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=128),
}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENGTHS]


def gpu_engine(model_dir, dtype="float32", **kw) -> Engine:
    kv = kw.pop("kv", KvCacheConfig(max_tokens=8192))
    return Engine(model_dir, dtype=dtype, device="cuda", max_seq_len=kw.pop("max_seq_len", 340), seed=0,
                  kv_cache_config=kv,
                  scheduler_config=SchedulerConfig(max_batch_size=kw.pop("max_batch_size", 8),
                                                   max_num_tokens=kw.pop("max_num_tokens", 512)), **kw)


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_models(checkpoint_factory):
    return lambda name: checkpoint_factory("gpu_" + name, **GPU_VARIANTS[name])


@pytest.mark.parametrize("variant", list(GPU_VARIANTS))
def test_fp32_greedy_equals_transformers_on_the_gpu(variant, gpu_models):
    model_dir = gpu_models(variant)
    engine = gpu_engine(model_dir)
    assert engine.startup_report()["cuda_graph_batch_sizes"] == [1, 2, 4, 8]
    results = engine.generate(prompts(), greedy(), use_tqdm=False)
    for p, r in zip(prompts(), results):
        assert r.token_ids == hf_greedy(model_dir, p, NEW_TOKENS, device="cuda"), f"prompt of {len(p)} tokens"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_stays_within_a_near_tie_of_fp32(dtype, gpu_models):
    """As the CPU's bf16 test (tests/test_correctness.py): teacher-forced, every token is the
    fp32 argmax or within NEAR_TIE_NOISES x transformers' own half-precision noise of it."""
    model_dir = gpu_models("llama_gqa")
    engine = gpu_engine(model_dir, dtype=dtype)
    results = engine.generate(prompts(), greedy(), use_tqdm=False)
    beyond, flips, positions = near_tie_check(model_dir, prompts(), [r.token_ids for r in results], dtype,
                                              device="cuda")
    assert beyond == [], f"(prompt length, position, gap, noise) beyond a near-tie: {beyond}"
    assert flips <= MAX_FLIP_FRACTION * positions, f"{flips} of {positions} tokens are not the fp32 argmax"


def mixed() -> list[SamplingParams]:
    return [greedy(40), SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.7, seed=2, max_tokens=30, ignore_eos=True, repetition_penalty=1.2),
            greedy(12), SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True, min_p=0.05),
            greedy(28), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1),
            greedy(33)]


def outputs(engine: Engine) -> list[tuple]:
    res = engine.generate(prompts(), mixed(), use_tqdm=False)
    return [(r.token_ids, r.finish_reason) for r in res]


@pytest.mark.parametrize("setup", [dict(), dict(max_batch_size=3, max_num_tokens=64)])
def test_graphs_and_overlap_change_no_output(setup, gpu_models):
    model_dir = gpu_models("llama_gqa")
    eager = outputs(gpu_engine(model_dir, cuda_graphs=False, **setup))
    graphed = gpu_engine(model_dir, **setup)
    replays = []
    real = graphed._runner.graphs.replay
    graphed._runner.graphs.replay = lambda size: replays.append(size) or real(size)
    assert outputs(graphed) == eager
    assert replays, "no decode batch replayed a graph"
    assert outputs(gpu_engine(model_dir, overlap=True, **setup)) == eager
    # one small graph: batches of 1-2 rows padded to 2, larger ones eager
    assert outputs(gpu_engine(model_dir, cuda_graph_batch_sizes=[2], **setup)) == eager


def test_kv_capacity_comes_from_cuda_memory_figures(gpu_models):
    model_dir = gpu_models("llama_gqa")
    budget = 64 * 2**20
    engine = gpu_engine(model_dir, kv=KvCacheConfig(max_memory_bytes=budget), max_seq_len=1024, max_batch_size=64)
    cap = engine.startup_report()["kv_capacity"]
    free, total = torch.cuda.mem_get_info()
    assert cap["source"] == "estimated"
    assert 0 < cap["peak_bytes"] < total
    assert cap["available_bytes"] <= total
    assert cap["budget_bytes"] == min(int(cap["available_bytes"] * 0.9), budget)
    assert cap["num_blocks"] == min(cap["budget_bytes"] // cap["bytes_per_block"], cap["seq_slot_cap_blocks"])
    assert engine._runner.kv_pool.is_cuda
    assert engine._runner.kv_pool_bytes == cap["num_blocks"] * cap["bytes_per_block"]


def test_a_failed_step_changes_nothing_on_the_gpu(gpu_models):
    model_dir = gpu_models("llama_gqa")
    calls = {"n": 0}

    def flaky(ids, logits):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected")
        return logits

    def run(inject: bool) -> list:
        engine = gpu_engine(model_dir, max_batch_size=4, max_num_tokens=64)
        params = [greedy(20), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                             logits_processors=[flaky] if inject else [])] + [greedy(20)] * 2
        for p, sp in zip(prompts()[2:6], params):
            engine.add_request(p, sp)
        tokens: dict[int, list[int]] = {}
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except RuntimeError as e:
                assert "injected" in str(e)
                continue
            for o in outs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [tokens[i] for i in sorted(tokens)]

    assert run(inject=True) == run(inject=False)


def test_fp8_kv_cache_stays_close(gpu_models):
    model_dir = gpu_models("llama_gqa")
    engine = gpu_engine(model_dir, dtype="bfloat16", kv=KvCacheConfig(max_tokens=8192, dtype="float8_e4m3"))
    assert engine._runner.kv_pool.dtype == torch.float8_e4m3fn
    results = engine.generate(prompts(), greedy(), use_tqdm=False)
    misses = sum(len(hf_topk_agrees(model_dir, p, r.token_ids, torch.bfloat16, k=5, device="cuda"))
                 for p, r in zip(prompts(), results))
    assert all(len(r.token_ids) == NEW_TOKENS for r in results)
    assert misses <= math.ceil(0.1 * NEW_TOKENS * len(PROMPT_LENGTHS)), misses


def test_longrope_decodes_eagerly_and_equals_transformers(checkpoint_factory):
    """A LongRoPE model's forward keeps per-slot bookkeeping a CUDA graph replay would skip: it
    runs without graphs, its greedy output transformers' across the switch point."""
    from pyengine.testing.checkpoints import longrope_scaling
    model_dir = checkpoint_factory("gpu_phi3_longrope", model_type="phi3", hidden_size=256, num_heads=4,
                                   num_kv_heads=2, original_max_position_embeddings=48,
                                   rope_scaling=longrope_scaling(64))
    engine = gpu_engine(model_dir)
    assert engine.startup_report()["cuda_graph_batch_sizes"] == []
    for prompt in ([5, 9, 44], list(range(3, 63))):  # below and beyond the switch point
        out = engine.generate(prompt, greedy(), use_tqdm=False)[0]
        assert out.token_ids == hf_greedy(model_dir, prompt, NEW_TOKENS, device="cuda")
