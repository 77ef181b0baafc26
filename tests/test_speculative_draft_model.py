"""Speculative decoding with a draft model (SpeculativeConfig(method="draft_model")): what is
particular to it. The behaviours both sources of drafts share (greedy outputs equal to
decoding without speculation across scheduling configurations, stop strings, max_tokens,
logprobs, abort, streaming, requests that may not speculate) are tests/test_speculative.py's,
run with each; the batch manager's placeholders and KV rewind: tests/cpp/test_speculative.cpp."""

from __future__ import annotations

import pytest
import torch

from pyengine import (Engine, KvCacheConfig, KvCacheFileError, SamplingParams, SchedulerConfig, SpeculativeConfig,
                      StartupError)
from pyengine.engine import kv_persistence
from pyengine.sampling.sampler import DraftRows, _verify_drafts
from pyengine.testing.checkpoints import build_tiny_checkpoint
from speculative_common import generate, greedy, make_prompts, seeded_params, total_variation


def make_engine(model_dir, draft, k: int = 4, **kw) -> Engine:
    spec = None if draft is None else SpeculativeConfig(method="draft_model", draft_model=draft,
                                                        num_speculative_tokens=k, adaptive_draft_length=False)
    return Engine(model_dir, max_seq_len=160, seed=0, speculative_config=spec, overlap=kw.pop("overlap", False),
                  kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=8),
                  scheduler_config=SchedulerConfig(max_batch_size=kw.pop("max_batch_size", 4), max_num_tokens=64))


def test_the_model_as_its_own_draft_has_every_draft_accepted(copying_dir):
    """A draft model computing what the model computes proposes what it samples: every draft is
    accepted -- which holds only if the draft model's KV cache is right at every position
    (prompt chunks, the drafts it fed itself, the last draft fed on the next step)."""
    prompts = make_prompts()
    reference = [o.token_ids for o in generate(make_engine(copying_dir, None), prompts, greedy())]
    engine = make_engine(copying_dir, copying_dir, k=3)
    outs = generate(engine, prompts, greedy())
    assert [o.token_ids for o in outs] == reference
    stats = engine.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"]
    # the first token comes with the prompt, then k + 1 = 4 a step: 11 steps for 44 tokens, and
    # a step with 2 drafts for the last 3 (drafts never pass max_tokens)
    assert [o.metrics.num_draft_tokens for o in outs] == [11 * 3 + 2] * len(prompts)


def test_startup_report_and_kv_capacity_count_the_draft_pool(copying_dir, draft_dir):
    plain, spec = make_engine(copying_dir, None), make_engine(copying_dir, draft_dir)
    report = spec.startup_report()["draft_model"]
    assert plain.startup_report()["draft_model"] is None
    assert report["path"] == str(draft_dir) and report["num_layers"] == 1
    # a block holds the model's 2 layers of K and V and the draft's 1: 1.5 times the bytes
    p_cap, s_cap = plain.startup_report()["kv_capacity"], spec.startup_report()["kv_capacity"]
    assert s_cap["bytes_per_block"] * 2 == p_cap["bytes_per_block"] * 3
    assert report["kv_pool_bytes"] * 3 == s_cap["pool_bytes"]


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_is_reproducible(copying_dir, draft_dir, overlap):
    """The draft's draws and the target's residual draws are counter-based on the request's
    seed: a seeded request gets the same tokens every run, with or without the overlap loop
    (though not those of decoding without speculation)."""
    prompts = make_prompts(2)
    params = seeded_params()
    first = generate(make_engine(copying_dir, draft_dir), prompts, params)
    engine = make_engine(copying_dir, draft_dir, overlap=overlap)
    again = generate(engine, prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    stats = engine.stats()
    assert 0 < stats["num_accepted_draft_tokens"] < stats["num_draft_tokens"]


def test_rejection_rule_emits_the_target_distribution():
    """Speculative sampling's rule on fixed distributions over 8 tokens, 40,000 seeds: the
    emitted token is distributed as the target's p whatever the draft's q, and a draft is
    accepted with probability sum(min(p, q))."""
    torch.manual_seed(0)
    n, vocab = 40_000, 8
    p = torch.tensor([0.30, 0.25, 0.15, 0.10, 0.10, 0.05, 0.05, 0.0])
    q = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.0, 0.10, 0.05, 0.05])
    draws = torch.multinomial(q, n, replacement=True)  # the draft's proposals, drawn from q
    rows = DraftRows(draws, q.expand(n, vocab).contiguous())
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 3
    generated = torch.zeros(n, dtype=torch.int64)
    from pyengine.sampling.sampler import counter_uniform
    u = counter_uniform(seeds, generated)
    tokens = _verify_drafts(p.expand(n, vocab).contiguous(), u, rows, seeds, generated)
    emitted = torch.bincount(tokens, minlength=vocab).double() / n
    assert 0.5 * float((emitted - p.double()).abs().sum()) < 0.01
    assert int(emitted[7] * n) == 0  # a token the target gives probability 0 is never emitted
    accepted = float((tokens == draws).double().mean())
    assert accepted == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.01)
    # without a draft (next token -1), a row draws from p with its own uniform number
    none = DraftRows(torch.full((n,), -1, dtype=torch.int64), rows.probs)
    plain = _verify_drafts(p.expand(n, vocab).contiguous(), u, none, seeds, generated)
    emitted = torch.bincount(plain, minlength=vocab).double() / n
    assert 0.5 * float((emitted - p.double()).abs().sum()) < 0.01


def test_sampled_tokens_follow_the_target_distribution(copying_dir, draft_dir):
    """The second generated token (the first a draft is verified for) over 600 seeds: its
    distribution with the draft model equals the one without speculation (total variation;
    the draws differ, so the bound allows for sampling noise)."""
    prompt = make_prompts(3, (12,))[0]
    params = [SamplingParams(temperature=0.02, seed=s, max_tokens=3, ignore_eos=True) for s in range(600)]

    def second_tokens(draft) -> torch.Tensor:
        engine = make_engine(copying_dir, draft, k=2, max_batch_size=16)
        return torch.tensor([o.token_ids[1] for o in generate(engine, [prompt] * len(params), params)])

    a, b = second_tokens(None), second_tokens(draft_dir)
    assert total_variation(a, b) < 0.12


def test_bad_draft_models_are_named(copying_dir, draft_dir, tmp_path):
    with pytest.raises(ValueError, match=r"speculative method 'draft_model' needs draft_model=<checkpoint directory>"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match=r"draft_model='x' is for method='draft_model', not 'ngram'"):
        SpeculativeConfig(draft_model="x")
    with pytest.raises(StartupError, match=r"phase 'config'.*does not exist"):
        make_engine(copying_dir, tmp_path / "missing")
    other = build_tiny_checkpoint(tmp_path / "other_tokenizer", num_heads=4, num_kv_heads=2, num_layers=1,
                                  tokenizer_vocab_size=300)
    with pytest.raises(StartupError, match=r"has another tokenizer than the model: its vocabulary \(300 tokens\)"):
        make_engine(copying_dir, other)
    short = build_tiny_checkpoint(tmp_path / "short", num_heads=4, num_kv_heads=2, num_layers=1,
                                  max_position_embeddings=64)
    with pytest.raises(StartupError, match=r"handles 64 positions \(max_position_embeddings\), fewer than the "
                                           r"engine's max_seq_len=160"):
        make_engine(copying_dir, short)


def drain(engine: Engine, prompts, params, budget_ms=None) -> list[list[int]]:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(budget_ms):
            if out.finished:
                done[out.request_id] = out.token_ids
    engine.check_resources()
    return [done[i] for i in ids]


@pytest.mark.parametrize("budget_ms", [2.0, 5.0])
def test_time_budgets_cut_drafts_not_outputs(copying_dir, draft_dir, budget_ms):
    """A time budget cuts a step's drafts and prompt chunks (the draft model drafts what was
    scheduled); outputs stay those without speculation or budget."""
    from pyengine import StepCostModel
    prompts = make_prompts(5)
    reference = generate(make_engine(copying_dir, None), prompts, greedy())
    spec = SpeculativeConfig(method="draft_model", draft_model=draft_dir, num_speculative_tokens=4)
    engine = Engine(copying_dir, max_seq_len=160, seed=0, speculative_config=spec,
                    kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=8),
                    scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64,
                                                     step_cost_model=StepCostModel(fixed_ms=1.0, per_token_ms=0.2)))
    assert drain(engine, prompts, greedy(), budget_ms) == [o.token_ids for o in reference]
    assert engine.stats()["num_accepted_draft_tokens"] > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_forward_after_drafting_changes_nothing(copying_dir, draft_dir, overlap):
    """The model's forward fails after the draft model has run (and written its cache): the
    step is undone, the drafter's state was not touched, and the run ends with the same
    outputs."""
    prompts = make_prompts(6)
    reference = [o.token_ids for o in generate(make_engine(copying_dir, None), prompts, greedy())]
    engine = make_engine(copying_dir, draft_dir, overlap=overlap)
    runner = engine._loop.runner
    original, calls = runner.forward, {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (5, 9):
            raise RuntimeError("injected forward failure")
        return original(*args, **kwargs)

    runner.forward = failing
    ids = [engine.add_request(p, greedy()) for p in prompts]
    done, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            failures += 1
            continue
        done.update((o.request_id, o.token_ids) for o in outs if o.finished)
    engine.check_resources()
    assert failures == 2
    assert [done[i] for i in ids] == reference
    assert engine.stats()["num_accepted_draft_tokens"] > 0


def json_length(path) -> int:
    with open(path, "rb") as f:
        return kv_persistence._HEAD.unpack(f.read(kv_persistence._HEAD.size))[2]


def test_a_saved_kv_cache_keeps_the_draft_kv(copying_dir, tmp_path):
    """save_kv_cache writes the draft pool's block beside the model's: with the model as its
    own draft, prefixes loaded from the file still have every draft accepted (an empty or
    stale draft cache would not), outputs equal, prefix reused."""
    prompts = make_prompts(7, (40, 48))
    warm = make_engine(copying_dir, copying_dir, k=3)  # (prefix reuse is on by default)
    first = generate(warm, prompts, greedy(16))
    path = tmp_path / "cache.pekv"
    saved = warm.save_kv_cache(path)
    plain_path = tmp_path / "plain.pekv"
    plain = make_engine(copying_dir, None)
    generate(plain, prompts, greedy(16))
    plain_saved = plain.save_kv_cache(plain_path)
    assert saved["blocks"] == plain_saved["blocks"] > 0
    # each record carries the draft pool's block after the model's (the headers differ too)
    header_growth = json_length(path) - json_length(plain_path)
    draft_block_bytes = warm._parts.drafter.kv_pool[:, :, 0].nbytes
    assert saved["bytes"] - plain_saved["bytes"] - header_growth == saved["blocks"] * draft_block_bytes

    engine = make_engine(copying_dir, copying_dir, k=3)
    engine.load_kv_cache(path)
    again = generate(engine, prompts, greedy(16))
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert all(o.metrics.num_reused_tokens > 0 for o in again)
    stats = engine.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_draft_tokens"] == stats["num_draft_tokens"]


def test_a_kv_cache_file_without_the_draft_kv_is_refused(copying_dir, draft_dir, tmp_path):
    """A file from an engine without the draft model (or with another one) has no (or other)
    draft K/V: refused, naming the field, the pool unchanged."""
    plain = make_engine(copying_dir, None)
    generate(plain, make_prompts(2, (40, 48)), greedy(4))
    plain.save_kv_cache(tmp_path / "plain.pekv")
    engine = make_engine(copying_dir, draft_dir)
    with pytest.raises(KvCacheFileError, match="fingerprint mismatch in 'draft': the file has None, "
                                               r"this engine has \{'model_files'"):
        engine.load_kv_cache(tmp_path / "plain.pekv")
    own = make_engine(copying_dir, copying_dir)
    generate(own, make_prompts(2, (40, 48)), greedy(4))
    own.save_kv_cache(tmp_path / "own.pekv")
    with pytest.raises(KvCacheFileError, match="fingerprint mismatch in 'draft'"):
        engine.load_kv_cache(tmp_path / "own.pekv")
    with pytest.raises(KvCacheFileError, match="fingerprint mismatch in 'draft': the file has \\{"):
        plain.load_kv_cache(tmp_path / "own.pekv")
    assert engine.stats()["num_reusable_blocks"] == 0


def test_the_model_quantized_as_its_own_draft(copying_dir):
    """draft_quantization: the model's own checkpoint, quantized at load, as the draft -- it
    agrees with the model most of the time; outputs are the model's."""
    prompts = make_prompts(8)
    reference = [o.token_ids for o in generate(make_engine(copying_dir, None), prompts, greedy())]
    spec = SpeculativeConfig(method="draft_model", draft_model=copying_dir, draft_quantization="Q8_0",
                             num_speculative_tokens=3)
    assert spec.draft_quantization == "q8_0"
    engine = Engine(copying_dir, max_seq_len=160, seed=0, speculative_config=spec,
                    kv_cache_config=KvCacheConfig(max_tokens=4096, tokens_per_block=8),
                    scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64))
    assert [o.token_ids for o in generate(engine, prompts, greedy())] == reference
    stats = engine.stats()
    assert stats["num_accepted_draft_tokens"] > 0.8 * stats["num_draft_tokens"] > 0
    assert engine._loop.drafter.model.quantized


def test_bad_draft_quantization_is_named(copying_dir):
    with pytest.raises(ValueError, match=r"draft_quantization='q4_0' is for method='draft_model', not 'ngram'"):
        SpeculativeConfig(draft_quantization="q4_0")
    with pytest.raises(ValueError, match=r"q9_9"):
        SpeculativeConfig(method="draft_model", draft_model=copying_dir, draft_quantization="q9_9")
    spec = SpeculativeConfig(method="draft_model", draft_model=copying_dir, draft_quantization="q4_0")
    with pytest.raises(StartupError, match=r"draft_quantization='q4_0' computes with float32 activations on "
                                           r"the CPU: dtype must be 'float32', got torch.bfloat16"):
        Engine(copying_dir, dtype="bfloat16", speculative_config=spec)
