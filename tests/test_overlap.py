"""The overlap loop: the same outputs as without it, one step later; atomic too."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from logprob_compare import assert_same_finals
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

PROMPTS = [list(range(10, 70)), [5, 9, 44, 71, 100, 3, 8], [300, 12, 17] * 9, [42] * 25, list(range(200, 240)),
           [7, 7, 8], list(range(400, 480))]


def make_engine(model_dir, overlap: bool, **kw) -> Engine:
    return Engine(model_dir, max_seq_len=kw.pop("max_seq_len", 128), seed=0, overlap=overlap,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=kw.pop("max_tokens", 4096)),
                  scheduler_config=SchedulerConfig(max_batch_size=kw.pop("max_batch_size", 4),
                                                   max_num_tokens=kw.pop("max_num_tokens", 24), **kw))


def mixed_params(stop_text: str | None = None, stop_token: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
            SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=24, ignore_eos=True, logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_text] if stop_text else []),
            SamplingParams(temperature=0.7, seed=2, max_tokens=20, stop_token_ids=[stop_token] if stop_token else []),
            SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, repetition_penalty=1.3),
            SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, min_p=0.05),
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)]


def drive(engine: Engine, params, abort_at: dict[int, int] | None = None) -> tuple[dict, list[list]]:
    """Runs the requests; abort_at maps request index -> call index of its abort. Returns
    the final outputs by index and the per-call lists of (index, new tokens)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    index = {rid: i for i, rid in enumerate(ids)}
    finals, calls, call = {}, [], 0
    while engine.has_unfinished_requests():
        for i, at in (abort_at or {}).items():
            if at == call:
                engine.abort_request(ids[i])
        outs = engine.step()
        calls.append(sorted((index[o.request_id], tuple(o.new_token_ids)) for o in outs))
        for o in outs:
            if o.finish_reason == "abort":
                finals[("abort call", index[o.request_id])] = call
        for o in outs:
            if o.finished:
                finals[index[o.request_id]] = final_of(o)
        call += 1
    return finals, calls


def final_of(o) -> tuple:
    """Tokens, reason, text and logprobs, compared by assert_same_finals: logprobs within a
    tolerance (batches of other shapes round the last float bits differently: the seat pool,
    and so the batches, differ with overlap)."""
    return o.token_ids, o.finish_reason, o.text, o.logprobs, o.prompt_logprobs


@pytest.fixture(scope="module")
def stops(llama_dir):
    """A stop string and a stop token that the plain run hits."""
    engine = make_engine(llama_dir, overlap=False)
    out = engine.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    text = out.text
    stop_text = next(text[i:i + 3] for i in range(8, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    return stop_text, 97


@pytest.mark.parametrize("setup", [
    dict(),                                                                   # chunked prefill
    dict(max_tokens=176, capacity_scheduler_policy="max_utilization"),        # preemption
    dict(max_batch_size=2, max_num_tokens=64),
])
def test_same_outputs_with_and_without_overlap(llama_dir, stops, setup):
    params = mixed_params(*stops)
    plain, plain_calls = drive(make_engine(llama_dir, False, **setup), params, abort_at={4: 6})
    over, over_calls = drive(make_engine(llama_dir, True, **setup), params, abort_at={4: 6})
    assert_same_finals(over, plain)
    assert plain[2][1] == "stop"  # the stop string ended it
    assert plain[4][1] == "abort"


def test_every_output_arrives_one_call_later(llama_dir, stops):
    """With seats for everyone the schedules match, so call k+1 with overlap returns
    exactly what call k returned without it."""
    params = mixed_params(*stops)
    setup = dict(max_batch_size=8, max_num_tokens=64)
    plain, plain_calls = drive(make_engine(llama_dir, False, **setup), params, abort_at={4: 6})
    over, over_calls = drive(make_engine(llama_dir, True, **setup), params, abort_at={4: 6})
    assert_same_finals(over, plain)
    # Token outputs are one call late; an abort's final output is not (it is not computed).
    assert over_calls[0] == []
    tokens = [[e for e in c if e[1]] for c in over_calls[1:]]
    assert tokens == [[e for e in c if e[1]] for c in plain_calls]
    assert over[("abort call", 4)] == plain[("abort call", 4)] == 6


def test_first_output_comes_one_step_later(llama_dir):
    for overlap, first_output_call in ((False, 0), (True, 1)):
        engine = make_engine(llama_dir, overlap)
        rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3))
        outs = [engine.step() for _ in range(3 + overlap)]
        assert [len(o) for o in outs].index(1) == first_output_call
        assert not engine.has_unfinished_requests()
        assert outs[-1][0].request_id == rid and outs[-1][0].finished


def test_overlap_doubles_the_seats_and_cleans_up_its_thread(llama_dir):
    engine = make_engine(llama_dir, True)
    assert engine.stats()["num_slots"] == 8
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    # The engine's own worker (other tests' engines may still be winding theirs down).
    workers = list(engine._loop._pool._threads)
    assert len(workers) == 1 and workers[0].is_alive() and workers[0] in threading.enumerate()
    ref = weakref.ref(engine)
    engine.shutdown()
    assert not workers[0].is_alive()
    del engine
    gc.collect()
    assert ref() is None


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("fail_at", [1, 5, 11])
def test_a_failed_overlapped_step_changes_nothing(llama_dir, stops, fail_at):
    params = mixed_params(*stops)
    expected, _ = drive(make_engine(llama_dir, False, max_tokens=176, capacity_scheduler_policy="max_utilization"),
                        params)
    engine = make_engine(llama_dir, True, max_tokens=176, capacity_scheduler_policy="max_utilization")
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    original = engine._runner.forward
    finals, call = {}, 0
    while engine.has_unfinished_requests():
        if call == fail_at:
            def failing(*a, **k):
                engine._runner.forward = original
                raise Boom("forward failed")
            engine._runner.forward = failing
            before = engine.stats()
            with pytest.raises(Boom):
                engine.step()
            after = engine.stats()
            before.pop("num_reusable_blocks"), after.pop("num_reusable_blocks")
            assert after == before
        for o in engine.step():
            if o.finished:
                finals[ids.index(o.request_id)] = final_of(o)
        call += 1
    assert_same_finals(finals, expected)
