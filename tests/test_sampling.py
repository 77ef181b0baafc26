"""The sampler: each transform against transformers' logits processors, the sampled
distribution, seeded reproducibility, penalties, min_tokens and logprobs end to end."""

from __future__ import annotations

import pytest
import torch
from transformers.generation import logits_process as hf

from hf_reference import hf_model
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig
from pyengine.sampling.sampler import (Sampler, greedy_tokens, apply_min_p, apply_presence_frequency, apply_repetition_penalty,
                              apply_top_k, apply_top_p, counter_uniform, sample_inverse_cdf)


def logits_batch(rows: int = 4, vocab: int = 200, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_temperature_matches_transformers():
    x = logits_batch()
    t = torch.tensor([0.5, 0.8, 1.0, 1.7])
    for i in range(4):
        ref = hf.TemperatureLogitsWarper(float(t[i]))(None, x[i:i + 1].clone())
        torch.testing.assert_close((x / t[:, None])[i:i + 1], ref, rtol=0, atol=0)


def test_top_k_matches_transformers_per_row():
    x = logits_batch()
    k = torch.tensor([1, 5, 50, 200])
    ours = apply_top_k(x, k)
    for i in range(4):
        ref = hf.TopKLogitsWarper(int(k[i]))(None, x[i:i + 1].clone())
        assert torch.equal(ours[i:i + 1], ref)


@pytest.mark.parametrize("vocab, scale, tail", [(200, 3.0, None), (5000, 8.0, None), (5000, 0.05, 4096),
                                               (5000, 1.0, 64)])
def test_top_p_matches_transformers_per_row(vocab, scale, tail):
    """Small vocab; a peaked large vocab (only the most likely sorted); a flat one (only the
    least likely sorted); one in between (sorted whole)."""
    x = logits_batch(vocab=vocab) * (scale / 3)
    p = torch.tensor([0.1, 0.5, 0.9, 1.0])
    ours = apply_top_p(x, p, tail_candidates=tail)
    for i in range(4):
        ref = hf.TopPLogitsWarper(float(p[i]))(None, x[i:i + 1].clone())
        assert torch.equal(ours[i:i + 1], ref)


@pytest.mark.parametrize("scale, p", [(8.0, [0.1, 0.5, 0.9, 1.0]), (0.05, [0.85, 0.9, 0.95, 1.0])])
def test_top_p_partial_sorts_match_transformers(monkeypatch, scale, p):
    """Peaked rows are decided within the most likely tokens, flat rows within the least
    likely: neither sorts a whole row (torch.sort is made to fail) and both equal transformers."""
    x = logits_batch(vocab=20000) * (scale / 3)
    top_p = torch.tensor(p)
    refs = [hf.TopPLogitsWarper(p[i])(None, x[i:i + 1].clone()) for i in range(4)]
    monkeypatch.setattr(torch, "sort", lambda *a, **k: pytest.fail("a whole row was sorted"))
    ours = apply_top_p(x, top_p)
    for i in range(4):
        assert torch.equal(ours[i:i + 1], refs[i])


def test_min_p_matches_transformers_per_row():
    x = logits_batch()
    mp = torch.tensor([0.0, 0.05, 0.3, 1.0])
    ours = apply_min_p(x, mp)
    for i in range(1, 4):  # transformers refuses min_p = 0
        ref = hf.MinPLogitsWarper(float(mp[i]))(None, x[i:i + 1].clone())
        assert torch.equal(ours[i:i + 1], ref)
    assert torch.equal(ours[0], x[0])


def test_repetition_penalty_matches_transformers_per_row():
    x = logits_batch()
    ids = [torch.tensor([[1, 5, 5, 9]]), torch.tensor([[0]]), torch.tensor([[3, 150, 199]]), torch.tensor([[7, 8]])]
    penalty = torch.tensor([1.3, 0.7, 2.0, 1.0])
    seen = torch.zeros_like(x, dtype=torch.bool)
    for i, t in enumerate(ids):
        seen[i, t[0]] = True
    ours = apply_repetition_penalty(x, seen, penalty)
    for i in range(4):
        ref = hf.RepetitionPenaltyLogitsProcessor(float(penalty[i]))(ids[i], x[i:i + 1].clone())
        torch.testing.assert_close(ours[i:i + 1], ref, rtol=0, atol=0)


def test_presence_and_frequency_penalties_follow_openai():
    x = logits_batch(rows=2, vocab=6)
    counts = torch.tensor([[0, 1, 3, 0, 0, 2], [5, 0, 0, 0, 1, 0]], dtype=torch.int32)
    presence, frequency = torch.tensor([0.5, -1.0]), torch.tensor([0.25, 1.5])
    expected = x.clone()
    for i in range(2):
        for j in range(6):
            c = int(counts[i, j])
            expected[i, j] -= float(frequency[i]) * c + (float(presence[i]) if c > 0 else 0.0)
    torch.testing.assert_close(apply_presence_frequency(x, counts, presence, frequency), expected)


def _empirical(probs: torch.Tensor, draws: int, seed: int) -> torch.Tensor:
    logits = probs.log().expand(draws, -1).contiguous()
    u = counter_uniform(torch.full((draws,), seed, dtype=torch.int64), torch.arange(draws))
    tokens = sample_inverse_cdf(logits, u)
    return torch.bincount(tokens, minlength=probs.numel()).double() / draws


@pytest.mark.parametrize("transform", ["plain", "temperature", "top_k", "top_p", "min_p"])
def test_sampled_frequencies_match_the_transformed_distribution(transform):
    """Total-variation distance between 40,000 draws and the expected distribution."""
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    x = base[None]
    if transform == "temperature":
        x = x / 0.6
    elif transform == "top_k":
        x = apply_top_k(x, torch.tensor([3]))
    elif transform == "top_p":
        x = apply_top_p(x, torch.tensor([0.8]))
    elif transform == "min_p":
        x = apply_min_p(x, torch.tensor([0.2]))
    expected = x.softmax(-1)[0].double()
    freq = _empirical(expected.float(), 40_000, seed=1234)
    tv = 0.5 * (freq - expected).abs().sum()
    assert tv < 0.01, (freq, expected)
    assert torch.all(freq[expected == 0] == 0), "a filtered token was sampled"


def test_counter_uniform_is_uniform_and_seed_dependent():
    u = counter_uniform(torch.full((100_000,), 7, dtype=torch.int64), torch.arange(100_000))
    assert 0 < float(u.min()) and float(u.max()) < 1
    hist = torch.histc(u.float(), bins=10, min=0, max=1) / 100_000
    assert torch.all((hist - 0.1).abs() < 0.005)
    v = counter_uniform(torch.full((100_000,), 8, dtype=torch.int64), torch.arange(100_000))
    assert float((u - v).abs().mean()) > 0.2


def test_all_greedy_batch_takes_the_argmax_fast_path():
    s = Sampler(num_slots=4, vocab_size=50, seed=0)
    s.init_slot(0, SamplingParams(temperature=0.0), [1, 2], [], [], seed=1)
    assert s.all_greedy
    x = logits_batch(rows=1, vocab=50)
    assert s.sample(x.clone(), torch.tensor([0])).tokens.tolist() == [int(x.argmax())]
    s.init_slot(1, SamplingParams(temperature=0.5), [1], [], [], seed=1)
    assert not s.all_greedy
    s.release_slot(1)
    assert s.all_greedy


# ---- end to end -----------------------------------------------------------------------------

PROMPTS = [[5, 9, 44, 71, 100, 3, 8], [300, 12, 17], list(range(10, 70)), [42] * 25, [7], list(range(100, 140))]


def make_engine(model_dir, **kw) -> Engine:
    return Engine(model_dir, max_seq_len=256, seed=kw.pop("seed", 0),
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=kw.pop("max_tokens", 4096)),
                  scheduler_config=SchedulerConfig(max_batch_size=kw.pop("max_batch_size", 16),
                                                   max_num_tokens=kw.pop("max_num_tokens", 128), **kw))


def mixed_batch() -> list[tuple[list[int], SamplingParams]]:
    """16 requests mixing greedy, seeded and unseeded, with different parameters."""
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.2, seed=5, max_tokens=20, ignore_eos=True),
    ]
    return [(PROMPTS[i % len(PROMPTS)], kinds[i % 4]) for i in range(16)]


def test_seeded_requests_are_reproducible_in_any_batch(llama_dir):
    target = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, presence_penalty=0.5, seed=42,
                            max_tokens=24, ignore_eos=True)
    alone = make_engine(llama_dir).generate([PROMPTS[2]], target, use_tqdm=False)[0].token_ids
    batch = mixed_batch()
    prompts = [p for p, _ in batch] + [PROMPTS[2]]
    params = [sp for _, sp in batch] + [target]
    in_batch = make_engine(llama_dir, seed=1).generate(prompts, params, use_tqdm=False)[-1].token_ids
    reversed_ = make_engine(llama_dir, seed=2).generate(prompts[::-1], params[::-1], use_tqdm=False)[0].token_ids
    small_batches = make_engine(llama_dir, max_batch_size=2, max_num_tokens=16).generate(
        prompts, params, use_tqdm=False)[-1].token_ids
    assert alone == in_batch == reversed_ == small_batches
    other_seed = SamplingParams(**{**target.__dict__, "seed": 43})
    assert make_engine(llama_dir).generate([PROMPTS[2]], other_seed, use_tqdm=False)[0].token_ids != alone


def test_seeded_sampling_survives_preemption(llama_dir):
    """A paused and recomputed request draws the same numbers again."""
    params = [SamplingParams(temperature=0.9, seed=100 + i, max_tokens=40, ignore_eos=True) for i in range(4)]
    prompts = [PROMPTS[2], PROMPTS[5], PROMPTS[3], PROMPTS[0]]
    big = make_engine(llama_dir).generate(prompts, params, use_tqdm=False)
    eng = Engine(llama_dir, max_seq_len=104, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=128),
                 scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=128,
                                                  capacity_scheduler_policy="max_utilization"))
    small = eng.generate(prompts, params, use_tqdm=False)
    assert sum(r.metrics.num_pauses for r in small) > 0
    assert [r.token_ids for r in small] == [r.token_ids for r in big]


def test_greedy_repetition_penalty_matches_transformers(llama_dir):
    from transformers import GenerationConfig
    model = hf_model(str(llama_dir))
    engine = make_engine(llama_dir)
    for prompt in PROMPTS[:3]:
        cfg = GenerationConfig(max_new_tokens=24, do_sample=False, repetition_penalty=1.5, eos_token_id=None,
                               pad_token_id=0)
        ref = model.generate(torch.tensor([prompt]), generation_config=cfg)[0, len(prompt):].tolist()
        out = engine.generate([prompt], SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=24,
                                                       ignore_eos=True), use_tqdm=False)[0]
        assert out.token_ids == ref


def test_min_tokens_masks_the_stop_tokens(llama_dir):
    engine = make_engine(llama_dir)
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                             use_tqdm=False)[0].token_ids
    stop = greedy[3]
    first = greedy.index(stop)
    plain = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]),
                            use_tqdm=False)[0]
    assert plain.token_ids == greedy[: first + 1]
    held = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop],
                                                        min_tokens=first + 2), use_tqdm=False)[0]
    assert stop not in held.token_ids[: first + 2]
    assert len(held.token_ids) >= first + 2


def test_min_tokens_masks_nothing_for_a_request_without_stop_tokens(llama_dir):
    """A slot's stop-token mask is rewritten only for a request with stop tokens under
    min_tokens; a later request in that slot with min_tokens but no stop tokens must not
    inherit the old mask (it did while another row kept the min_tokens mask active).
    Found by the soak (tests/test_soak.py)."""
    b_params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=True)
    alone = make_engine(llama_dir, max_batch_size=2).generate([PROMPTS[0]], b_params, use_tqdm=False)[0].token_ids
    t = alone[2]
    engine = make_engine(llama_dir, max_batch_size=2)
    # both seats: rows that mask t under min_tokens
    engine.generate([PROMPTS[1], PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2,
                                                             stop_token_ids=[t]), use_tqdm=False)
    neighbour = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, stop_token_ids=[t], ignore_eos=True)
    outs = engine.generate([PROMPTS[0], PROMPTS[1]], [b_params, neighbour], use_tqdm=False)
    assert outs[0].token_ids == alone


def test_logprobs_are_the_models_raw_distribution(llama_dir):
    engine = make_engine(llama_dir)
    prompt = PROMPTS[2]
    out = engine.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True,
                                                   logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    model = hf_model(str(llama_dir))
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt + out.token_ids])).logits[0].float(), dim=-1)
    assert len(out.logprobs) == 12
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(lp) and token in lp
        assert len(lp) in (3, 4)
        for t, v in lp.items():
            assert abs(v - float(row[t])) < 1e-4
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        lp = out.prompt_logprobs[pos]
        assert abs(lp[prompt[pos]] - float(ref[pos - 1, prompt[pos]])) < 1e-4
        assert set(ref[pos - 1].topk(2).indices.tolist()) <= set(lp)


def test_prompt_logprobs_across_chunks(llama_dir):
    engine = make_engine(llama_dir, max_num_tokens=16)  # the 60-token prompt takes 4 chunks
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0),
                          use_tqdm=False)[0]
    model = hf_model(str(llama_dir))
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([PROMPTS[2]])).logits[0].float(), dim=-1)
    got = [out.prompt_logprobs[p][PROMPTS[2][p]] for p in range(1, 60)]
    want = [float(ref[p - 1, PROMPTS[2][p]]) for p in range(1, 60)]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert all(len(d) == 1 for d in out.prompt_logprobs[1:])


def test_counter_uniform_reaches_one_at_its_top():
    """The largest counter output rounds up to exactly 1.0 in float64: the rounding case below
    is reachable from real draws, not only from hand-made numbers."""
    top = (float((1 << 53) - 1) + 0.5) / float(1 << 53)
    assert top == 1.0


@pytest.mark.parametrize("vocab", [300, 512])  # 300: the last group is padding; 512: no padding
def test_inverse_cdf_never_returns_a_token_of_zero_probability(vocab):
    """u = 1.0 puts the target at the last cumulative sum; searchsorted then lands past every
    token of probability > 0 (on the padding, or on filtered tokens at the end of the
    vocabulary). The sampler must step back to the last token it may draw."""
    logits = torch.full((3, vocab), float("-inf"))
    logits[0, :5] = 0.0                       # allowed: 0..4, the rest filtered
    logits[1, [7, 100, 250]] = torch.tensor([1.0, 2.0, 0.5])
    logits[2, 0] = 0.0                        # a single allowed token
    u = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)
    tokens = sample_inverse_cdf(logits, u)
    assert tokens.tolist() == [4, 250, 0]
    probs = logits.softmax(-1)
    assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_inverse_cdf_steps_back_inside_a_group():
    """The group's float64 total and its inner cumulative sum can differ in the last bit; a
    target between them lands on the group's trailing filtered tokens. Forced here by a target
    just under the group total with the allowed tokens at the group's start."""
    logits = torch.full((1, 256), float("-inf"))
    logits[0, :3] = torch.tensor([0.1, 0.2, 0.3])
    u = torch.tensor([1.0], dtype=torch.float64)
    assert sample_inverse_cdf(logits, u).tolist() == [2]
    # an ordinary draw is unchanged by the step-back
    assert sample_inverse_cdf(logits, torch.tensor([0.0], dtype=torch.float64)).tolist() == [0]


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 1000, 32000, 151936])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_greedy_tokens_are_torch_argmax_with_its_ties_and_nans(vocab, threads, cpu_isa):
    """pyengine's argmax kernel (fp32 on the CPU) picks what torch.argmax picks: the first of equal
    largest values (-0.0 and 0.0 are equal), the first NaN of a row that has one; rows `stride`
    apart (a slice of a wider buffer); a long row split between threads (ties and NaNs in either
    thread's span), at every instruction-set level."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_greedy_tokens(vocab)
    finally:
        torch.set_num_threads(old)


def check_greedy_tokens(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    wide = torch.randn(8, vocab + 3, generator=g)
    x = wide[:, :vocab]
    x[1] = 2.0                                    # all equal: index 0
    x[2, vocab // 2:] = 7.0                       # ties at the top: the first of them
    x[3] = float("-inf")                          # all -inf
    x[4, vocab - 1] = float("nan")                # a NaN wins, wherever it is
    x[5, :] = -1.0
    x[5, vocab // 3] = -0.0                       # -0.0 and 0.0 are one value
    x[5, vocab - 1] = 0.0
    x[6, vocab // 2] = float("nan")
    x[6, vocab - 1] = float("nan")
    x[7, 0] = float("inf")
    got = greedy_tokens(x)
    assert got.dtype == torch.int32 and x.stride(0) == vocab + 3
    assert got.tolist() == torch.argmax(x, dim=-1).tolist()
    assert got[4] == vocab - 1 and got[6] == vocab // 2
    if vocab >= 1000:  # the largest value twice, in the last and the first span: the first one
        y = torch.randn(4, vocab, generator=g)
        y[0, vocab - 2] = y[0, 3] = 9.0
        y[1, vocab - 1] = y[1, vocab // 2 - 1] = 9.0
        y[2, :] = -0.0                            # all -0.0 but a 0.0 at the end: index 0
        y[2, vocab - 1] = 0.0
        y[3, :] = -2.0                            # 0.0 late, -0.0 later: the first of them
        y[3, vocab - 5] = 0.0
        y[3, vocab - 3] = -0.0
        assert greedy_tokens(y).tolist() == torch.argmax(y, dim=-1).tolist() == [3, vocab // 2 - 1, 0, vocab - 5]


def test_greedy_tokens_of_other_dtypes_and_no_rows():
    x = torch.randn(3, 50).to(torch.bfloat16)  # not the kernel's: torch's argmax
    assert torch.equal(greedy_tokens(x), torch.argmax(x, dim=-1).to(torch.int32))
    assert greedy_tokens(torch.zeros(0, 50)).tolist() == []
