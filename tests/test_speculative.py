"""Speculative decoding (SpeculativeConfig): greedy and seeded outputs are those of decoding
without it, in every scheduling configuration; drafts that are all right, all wrong or
partly right; stop strings, stop tokens and max_tokens inside accepted drafts; logprobs;
abort; requests that must not speculate; metrics. The batch manager's side (exact metadata,
KV rewind with exact block ids): tests/cpp/test_speculative.cpp."""

from __future__ import annotations

import random

import pytest
import torch

from hf_reference import hf_greedy
from speculative_common import (NEW_TOKENS, PROMPT_LENGTHS, generate, greedy, make_prompts, seeded_params,
                                total_variation)
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig, SpeculativeConfig, StartupError



@pytest.fixture(params=["ngram", "draft_model"])
def spec(request, draft_dir) -> SpeculativeConfig:
    """Each source of drafts, 4 a step: prompt lookup, and the draft model (a fixed count: the
    tiny draft model costs nearly what the model does, so adaptive drafting would rarely draft;
    the adaptive draft length has tests of its own)."""
    if request.param == "ngram":
        return SPEC
    return SpeculativeConfig(method="draft_model", draft_model=draft_dir, num_speculative_tokens=4,
                             adaptive_draft_length=False)


def make_engine(model_dir, spec: SpeculativeConfig | None, *, overlap=False, max_batch_size=4, max_num_tokens=64,
                max_tokens=4096, policy="guaranteed_no_evict", reuse=False, chunked=True) -> Engine:
    return Engine(model_dir, max_seq_len=160, seed=0, overlap=overlap, speculative_config=spec,
                  kv_cache_config=KvCacheConfig(max_tokens=max_tokens, tokens_per_block=8, enable_block_reuse=reuse),
                  scheduler_config=SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                                   capacity_scheduler_policy=policy,
                                                   enable_chunked_prefill=chunked))


@pytest.fixture(scope="module")
def reference(copying_dir):
    """Outputs without speculation (greedy), computed once."""
    return [o.token_ids for o in generate(make_engine(copying_dir, None), make_prompts(), greedy())]


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3,
                         adaptive_draft_length=False)


@pytest.mark.parametrize("setup", [
    dict(),
    dict(overlap=True),
    dict(max_num_tokens=16),                                   # drafts compete with prompt chunks
    dict(max_tokens=160, policy="max_utilization"),            # pauses and recomputation
    dict(max_tokens=160, policy="max_utilization", overlap=True),
    dict(reuse=True),                                          # prefix reuse (drafts are never cached)
    dict(max_batch_size=1),
    dict(chunked=False),
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "default")
def test_greedy_outputs_are_those_without_speculation(copying_dir, spec, reference, setup):
    engine = make_engine(copying_dir, spec, **setup)
    outs = generate(engine, make_prompts(), greedy())
    assert [o.token_ids for o in outs] == reference
    stats = engine.stats()
    # the test means something only if drafts were both accepted and rejected
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]
    rates = [o.metrics.draft_acceptance_rate for o in outs if o.metrics.num_draft_tokens]
    assert rates and all(r == o.metrics.num_accepted_draft_tokens / o.metrics.num_draft_tokens
                         for r, o in zip(rates, [o for o in outs if o.metrics.num_draft_tokens]))
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats["num_draft_tokens"]
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) == stats["num_accepted_draft_tokens"]
    if setup.get("policy") == "max_utilization":
        assert sum(o.metrics.num_pauses for o in outs) > 0, "the pool was meant to force pauses"
    if setup.get("reuse"):  # a second round takes the prompts (and verified outputs) from the cache
        again = generate(engine, make_prompts(), greedy())
        assert [o.token_ids for o in again] == reference
        assert engine.stats()["total_reused_tokens"] > 0


def test_greedy_outputs_equal_transformers_on_a_model_that_rarely_copies(llama_dir):
    prompts = make_prompts(1, (7, 33, 64))
    # transformers stops at the model's end-of-sequence token (config.json), and so do we here
    outs = generate(make_engine(llama_dir, SPEC), prompts, SamplingParams(temperature=0.0, max_tokens=32))
    assert [o.token_ids for o in outs] == [hf_greedy(llama_dir, p, 32, stop_at_eos=True) for p in prompts]


def drive(engine: Engine, prompts, params, drafts_for) -> list:
    """Runs the prompts to completion (plain loop), setting every generating request's drafts
    for each step to drafts_for(index, tokens so far). `params`: one for all, or one each."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, each)]
    index = {rid: i for i, rid in enumerate(ids)}
    done = {}
    while engine.has_unfinished_requests():
        for core_id, rec in engine._requests.records.items():
            if rec.token_ids:
                engine._bm.set_draft_tokens(core_id, drafts_for(index[rec.request_id], rec.token_ids))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_resources()
    return [done[rid] for rid in ids]


def test_right_drafts_are_all_accepted(copying_dir, reference):
    k = 4
    engine = make_engine(copying_dir, SpeculativeConfig(num_speculative_tokens=k))
    outs = drive(engine, make_prompts(), greedy(), lambda i, toks: reference[i][len(toks):len(toks) + k])
    assert [o.token_ids for o in outs] == reference
    stats = engine.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"]
    # the first token comes with the prompt; then each step gives k + 1 (the last step fewer)
    assert engine._loop.timings()["steps"] <= 1 + len(PROMPT_LENGTHS) * -(-(NEW_TOKENS - 1) // (k + 1)) + 2


def test_wrong_drafts_are_all_rejected(copying_dir, reference):
    rng = random.Random(5)
    engine = make_engine(copying_dir, SpeculativeConfig(num_speculative_tokens=3))

    def wrong(i, toks):
        right = reference[i][len(toks)] if len(toks) < len(reference[i]) else -1
        return [t for t in (rng.randrange(3, 500) for _ in range(3)) if t != right][:1] * 3

    outs = drive(engine, make_prompts(), greedy(), wrong)
    assert [o.token_ids for o in outs] == reference
    assert engine.stats()["num_draft_tokens"] > 0 and engine.stats()["num_accepted_draft_tokens"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_is_that_without_speculation(copying_dir, overlap):
    # the counter-based sampler draws token g of a request from (its logits, seed, g) alone,
    # and a prompt-lookup draft is accepted exactly when the draw equals it: the emitted
    # tokens are the draws of decoding without speculation
    prompts = make_prompts(2)
    params = seeded_params()
    plain = generate(make_engine(copying_dir, None), prompts, params)
    engine = make_engine(copying_dir, SPEC, overlap=overlap)
    spec = generate(engine, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats()["num_accepted_draft_tokens"] > 0


def test_accepted_tokens_follow_the_target_distribution(copying_dir):
    """Sampling over many seeds with drafts forced at every step (the greedy continuation):
    the distribution of the second generated token equals the one without speculation (total
    variation over 600 draws each; the same seeds, so equal draws are expected -- the bound
    allows for a forward whose logits differ in the last bits)."""
    prompt = make_prompts(3, (12,))[0]
    seeds = range(600)

    def second_tokens(spec: bool) -> torch.Tensor:
        engine = make_engine(copying_dir, SpeculativeConfig(num_speculative_tokens=2) if spec else None,
                             max_batch_size=16)
        params = [SamplingParams(temperature=0.02, seed=s, max_tokens=3, ignore_eos=True) for s in seeds]
        if spec:
            first = generate(make_engine(copying_dir, None), [prompt], greedy(max_tokens=3))[0].token_ids
            outs = drive(engine, [prompt] * len(params), params, lambda i, toks: first[len(toks):len(toks) + 2])
        else:
            outs = generate(engine, [prompt] * len(params), params)
        return torch.tensor([o.token_ids[1] for o in outs])

    a, b = second_tokens(False), second_tokens(True)
    assert total_variation(a, b) < 0.12


def test_stop_strings_and_stop_tokens_inside_accepted_drafts(copying_dir, spec, reference):
    engine_plain = make_engine(copying_dir, None)
    engine_spec = make_engine(copying_dir, spec)
    tok = engine_plain.tokenizer
    prompts = make_prompts()
    cases = []
    for i, ref in enumerate(reference):
        for pos in (9, 17, 26):
            cases.append((prompts[i], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                     stop=[tok.decode([ref[pos]])])))
            cases.append((prompts[i], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                     stop_token_ids=[ref[pos]])))
    plain = generate(engine_plain, [c[0] for c in cases], [c[1] for c in cases])
    spec = generate(engine_spec, [c[0] for c in cases], [c[1] for c in cases])
    for p, s in zip(plain, spec):
        assert (s.token_ids, s.text, s.finish_reason, s.stop_reason) == (p.token_ids, p.text, p.finish_reason,
                                                                          p.stop_reason)
    # (a token's text may be empty, or complete only with the next token: not every case stops)
    assert sum(p.finish_reason == "stop" and len(p.token_ids) < NEW_TOKENS for p in plain) >= len(cases) // 2
    assert engine_spec.stats()["num_accepted_draft_tokens"] > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
def test_max_tokens_is_never_passed(copying_dir, spec, reference, max_tokens):
    outs = generate(make_engine(copying_dir, spec), make_prompts(), greedy(max_tokens=max_tokens))
    assert [o.token_ids for o in outs] == [r[:max_tokens] for r in reference]
    assert all(o.finish_reason == "length" for o in outs)


def test_logprobs_of_accepted_drafts(copying_dir, spec):
    prompts = make_prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = generate(make_engine(copying_dir, None), prompts, params)
    engine = make_engine(copying_dir, spec)
    spec = generate(engine, prompts, params)
    assert engine.stats()["num_accepted_draft_tokens"] > 0
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids and len(s.logprobs) == len(p.logprobs) == 24
        for lp, lq in zip(p.logprobs, s.logprobs):
            assert lp.keys() == lq.keys()
            for t in lp:
                assert lq[t] == pytest.approx(lp[t], abs=1e-4)


def test_streamed_outputs_carry_every_new_token_once(copying_dir, spec, reference):
    engine = make_engine(copying_dir, spec)
    prompts = make_prompts()
    ids = [engine.add_request(p, greedy()) for p in prompts]
    streamed = {rid: [] for rid in ids}
    multi = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.new_token_ids
            assert out.token_ids == streamed[out.request_id]
            multi += len(out.new_token_ids) > 1
    assert [streamed[rid] for rid in ids] == reference
    assert multi > 0, "some step gave a request several tokens"


def test_abort_while_speculating(copying_dir, spec, reference):
    engine = make_engine(copying_dir, spec)
    prompts = make_prompts()
    ids = [engine.add_request(p, greedy()) for p in prompts]
    for _ in range(8):
        engine.step()
    assert engine.stats()["num_draft_tokens"] > 0
    assert engine.abort_request(ids[2])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_resources()
    assert done[ids[2]].finish_reason == "abort"
    assert [done[rid].token_ids for i, rid in enumerate(ids) if i != 2] == [r for i, r in enumerate(reference) if i != 2]


def test_requests_with_penalties_or_processors_do_not_speculate(copying_dir, spec):
    engine = make_engine(copying_dir, spec)
    prompts = make_prompts()[:3]
    params = [greedy(), greedy(repetition_penalty=1.3), greedy(logits_processors=[lambda ids, x: x])]
    outs = generate(engine, prompts, params)
    assert outs[0].metrics.num_draft_tokens > 0
    assert outs[1].metrics.num_draft_tokens == 0 and outs[2].metrics.num_draft_tokens == 0
    plain = generate(make_engine(copying_dir, None), prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_bad_speculative_configuration_is_named(copying_dir):
    with pytest.raises(ValueError, match=r"speculative method must be one of \('ngram', 'draft_model'\), got 'eagle'"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be a positive int, got 0"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"prompt_lookup_max \(1\) must be at least prompt_lookup_min \(2\)"):
        SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=1)
    with pytest.raises(StartupError, match=r"num_speculative_tokens \(64\) must be below max_num_tokens \(64\)"):
        make_engine(copying_dir, SpeculativeConfig(num_speculative_tokens=64))
    with pytest.raises(StartupError, match=r"speculative_config must be a SpeculativeConfig or None, got dict"):
        Engine(copying_dir, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match=r"draft_row_cost must be a finite number >= 0 \(or None\), got -0.5"):
        SpeculativeConfig(draft_row_cost=-0.5)
    with pytest.raises(ValueError, match=r"draft_propose_cost must be a finite number >= 0 \(or None\), got inf"):
        SpeculativeConfig(draft_propose_cost=float("inf"))
    with pytest.raises(TypeError, match=r"adaptive_draft_length must be a bool, got 'yes'"):
        SpeculativeConfig(adaptive_draft_length="yes")


def test_adaptive_draft_length_stops_drafts_that_do_not_pay(copying_dir, reference):
    """The model as its own draft costs a whole forward a draft (draft_propose_cost 1.0 from
    the two models' bytes): never worth it, so each request only probes with one draft every
    9 steps -- all accepted, outputs unchanged. Told that drafting is free, the same engine
    drafts every step."""
    prompts = make_prompts()
    own = SpeculativeConfig(method="draft_model", draft_model=copying_dir, num_speculative_tokens=4)
    engine = make_engine(copying_dir, own)
    assert engine.startup_report()["adaptive_draft_length"] == {"draft_row_cost": 0.12, "draft_propose_cost": 1.0}
    outs = generate(engine, prompts, greedy())
    assert [o.token_ids for o in outs] == reference
    # 47 tokens after the first: a probe step gives 2, the 8 steps before it 1 each
    assert [o.metrics.num_draft_tokens for o in outs] == [4] * len(prompts)
    assert [o.metrics.num_accepted_draft_tokens for o in outs] == [4] * len(prompts)
    free = make_engine(copying_dir, SpeculativeConfig(method="draft_model", draft_model=copying_dir,
                                                      num_speculative_tokens=4, draft_propose_cost=0.0,
                                                      draft_row_cost=0.0))
    outs = generate(free, prompts, greedy())
    assert [o.token_ids for o in outs] == reference
    # every draft accepted and free: 4 a step (5 tokens) for 45 of the 47 tokens after the
    # first, then 1 (drafts never pass max_tokens)
    assert [o.metrics.num_draft_tokens for o in outs] == [9 * 4 + 1] * len(prompts)
    ngram = make_engine(copying_dir, SpeculativeConfig(num_speculative_tokens=4))
    assert ngram.startup_report()["adaptive_draft_length"] == {"draft_row_cost": 0.12, "draft_propose_cost": 0.0}
    assert make_engine(copying_dir, SPEC).startup_report()["adaptive_draft_length"] is None
