"""Prefix reuse end to end: outputs are token-identical to runs without reuse, with shared
prefixes arriving together or later, under heavy preemption and with priorities."""

from __future__ import annotations

import random

import pytest

from logprob_compare import assert_logprobs_close
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig, StartupError

SYSTEM = [random.Random(7).randrange(3, 512) for _ in range(70)]


def prompts_with_shared_prefix(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [SYSTEM[: rng.choice([17, 40, 70])] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 20))]
            for _ in range(n)]


def make_engine(model_dir, *, reuse: bool, max_tokens: int = 8192, policy="guaranteed_no_evict",
                queue="fcfs", max_batch_size=8, max_num_tokens=64) -> Engine:
    return Engine(model_dir, max_seq_len=128,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=max_tokens, enable_block_reuse=reuse),
                  scheduler_config=SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                                   capacity_scheduler_policy=policy, queue_policy=queue))


PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llama_dir):
    prompts = prompts_with_shared_prefix(12)
    outs = make_engine(llama_dir, reuse=False).generate(prompts, PARAMS, use_tqdm=False)
    return prompts, [o.token_ids for o in outs]


def test_shared_prefix_in_the_same_step_and_later(llama_dir, reference):
    prompts, expected = reference
    engine = make_engine(llama_dir, reuse=True)
    first = engine.generate(prompts[:6], PARAMS, use_tqdm=False)   # arrive together
    later = engine.generate(prompts[6:], PARAMS, use_tqdm=False)   # arrive after: blocks cached
    assert [o.token_ids for o in first + later] == expected
    assert all(o.metrics.num_reused_tokens > 0 for o in later)
    stats = engine.stats()
    assert stats["total_reused_tokens"] == sum(o.metrics.num_reused_tokens for o in first + later) > 0
    assert stats["num_reusable_blocks"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_identical_prompts_submitted_together_compute_the_prefix_once(llama_dir, reference):
    prompts, expected = reference
    engine = make_engine(llama_dir, reuse=True, max_num_tokens=512)
    outs = engine.generate([prompts[0]] * 4, PARAMS, use_tqdm=False)
    assert all(o.token_ids == expected[0] for o in outs)
    full_blocks = (len(prompts[0]) - 1) // 8
    # the first computes it; the others wait one step and take its blocks
    assert sorted(o.metrics.num_reused_tokens for o in outs) == [0] + [full_blocks * 8] * 3


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_heavy_preemption_with_reuse(llama_dir, reference, policy):
    prompts, expected = reference
    # a pool a few blocks larger than one request needs (128 tokens -> 16 blocks)
    engine = make_engine(llama_dir, reuse=True, max_tokens=8 * 20, policy=policy)
    outs = engine.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    if policy == "max_utilization":
        assert sum(o.metrics.num_pauses for o in outs) > 0


def test_priorities_do_not_change_outputs_and_order_the_start(llama_dir, reference):
    prompts, expected = reference
    engine = make_engine(llama_dir, reuse=True, queue="priority", max_batch_size=2)
    prios = [0.3, 1.0, 0.5, 0.6] * 3
    ids = [engine.add_request(p, PARAMS, priority=pr) for p, pr in zip(prompts, prios)]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
    assert [final[i].token_ids for i in ids] == expected
    starts = sorted(ids, key=lambda i: final[i].metrics.first_scheduled_time)
    started_prios = [prios[ids.index(i)] for i in starts]
    assert started_prios[2:] == sorted(started_prios[2:], reverse=True)  # after the first two seats


def test_cache_salt_isolates_tenants(llama_dir, reference):
    prompts, expected = reference
    engine = make_engine(llama_dir, reuse=True)
    a = engine.generate([prompts[0]], PARAMS, use_tqdm=False)[0]
    rid = engine.add_request(prompts[0], PARAMS, cache_salt="tenant-b")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[rid].metrics.num_reused_tokens == 0
    assert outs[rid].token_ids == a.token_ids == expected[0]
    same = engine.add_request(prompts[0], PARAMS, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs[same].metrics.num_reused_tokens > 0


def test_seat_pool_must_fit_in_the_kv_pool(llama_dir):
    with pytest.raises(StartupError, match="phase 'kv_capacity'.*cannot cover the sequence slot pool \\(64 sequence slots"):
        Engine(llama_dir, max_seq_len=64, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256),
               scheduler_config=SchedulerConfig(max_batch_size=64))


def test_prompt_logprobs_are_complete_when_the_prefix_is_cached(llama_dir):
    """A request with prompt_logprobs takes no blocks from the cache (the logprobs of
    reused positions would never be computed: it got [None] alone for a cached prompt), and
    its own blocks still serve the requests after it. Found by the soak (tests/test_soak.py)."""
    prompt = SYSTEM[:33]
    engine = make_engine(llama_dir, reuse=True)
    engine.generate([prompt], PARAMS, use_tqdm=False)  # caches the prompt's full blocks
    wanted = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    out = engine.generate([prompt], wanted, use_tqdm=False)[0]
    cold = make_engine(llama_dir, reuse=False).generate([prompt], wanted, use_tqdm=False)[0]
    assert out.metrics.num_reused_tokens == 0
    assert len(out.prompt_logprobs) == len(prompt)
    assert_logprobs_close(out.prompt_logprobs, cold.prompt_logprobs)
    assert out.token_ids == cold.token_ids
    later = engine.generate([prompt + [5]], PARAMS, use_tqdm=False)[0]
    assert later.metrics.num_reused_tokens == 32
