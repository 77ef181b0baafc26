"""Request ids: ints or strs, chosen by the caller or assigned by the engine; each names one
live request, and a finished one can be named again."""

from __future__ import annotations

import pytest

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def make_engine(model_dir, overlap: bool = False) -> Engine:
    return Engine(model_dir, max_seq_len=128, overlap=overlap,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64))


def drain(engine: Engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finals, f"{out.request_id!r} got an output after its final one"
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.mark.parametrize("overlap", [False, True])
def test_str_and_int_ids_name_their_own_requests(llama_dir, overlap):
    engine = make_engine(llama_dir, overlap)
    prompts = {"a": [5, 9, 44], "b": [300, 12, 17, 8], 3: [42] * 10, "3": [7, 7, 8]}
    for rid, prompt in prompts.items():
        assert engine.add_request(prompt, GREEDY, request_id=rid) == rid
    auto = engine.add_request([1, 2, 3], GREEDY)
    assert isinstance(auto, int) and auto != 3
    finals = drain(engine)
    assert set(finals) == {"a", "b", 3, "3", auto}
    for rid, prompt in prompts.items():
        assert finals[rid].prompt_token_ids == prompt and len(finals[rid].token_ids) == 4
    # the same greedy prompt gives the same tokens whatever its id
    again = make_engine(llama_dir).generate([prompts["3"]], GREEDY, use_tqdm=False)[0]
    assert finals["3"].token_ids == again.token_ids


def test_str_ids_abort_stream_and_reuse(llama_dir):
    engine = make_engine(llama_dir)
    engine.add_request([5, 9, 44], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), request_id="long")
    with pytest.raises(ValueError, match="request_id 'long' is already in use"):
        engine.add_request([1, 2], GREEDY, request_id="long")
    engine.step()
    assert engine.abort_request("long") is True
    finals = drain(engine)
    assert finals["long"].finish_reason == "abort"
    assert engine.abort_request("long") is False  # finished: known, nothing to do
    with pytest.raises(ValueError, match="unknown request_id 'never'"):
        engine.abort_request("never")
    outs = list(engine.stream([300, 12, 17], GREEDY, request_id="long"))  # a finished id may be used again
    assert [o.request_id for o in outs] == ["long"] * 4 and outs[-1].finished
    engine.check_resources()


@pytest.mark.parametrize("bad, error, match", [
    (1.5, TypeError, "request_id must be an int or a str, got 1.5"),
    (True, TypeError, "request_id must be an int or a str, got True"),
    (-1, ValueError, r"request_id must be in \[0, 2\*\*63\), got -1"),
    (2**63, ValueError, r"request_id must be in \[0, 2\*\*63\), got 9223372036854775808"),
])
def test_bad_request_ids_are_named_and_change_nothing(llama_dir, bad, error, match):
    engine = make_engine(llama_dir)
    with pytest.raises(error, match=match):
        engine.add_request([1, 2, 3], GREEDY, request_id=bad)
    assert not engine.has_unfinished_requests() and engine.stats()["num_requests"] == 0


def test_finished_id_memory_is_bounded(llama_dir, monkeypatch):
    """A long-running engine remembers finished ids in bounded memory: ids it assigned cost
    nothing (every one below the next was in use once); the caller's own ids, the latest
    FINISHED_IDS_KEPT of them."""
    import pyengine.engine.requests as requests_module
    monkeypatch.setattr(requests_module, "FINISHED_IDS_KEPT", 3)
    engine = make_engine(llama_dir)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    auto = [engine.add_request([1, 2, 3], one) for _ in range(20)]
    mine = [engine.add_request([4, 5], one, request_id=f"job-{i}") for i in range(5)]
    big = engine.add_request([6], one, request_id=10**12)  # a caller's int beyond the assigned range
    drain(engine)
    table = engine._requests
    assert list(table._finished) == ["job-3", "job-4", 10**12]  # the assigned ids take no entries
    assert not any(engine.abort_request(rid) for rid in auto + mine[3:] + [big])  # finished: False
    with pytest.raises(ValueError, match="unknown request_id 'job-0'"):  # forgotten: the bound held
        engine.abort_request("job-0")
    with pytest.raises(ValueError, match="unknown request_id 20"):  # never assigned yet
        engine.abort_request(20)
    assert engine.add_request([1], one) == 20  # the next assigned id
    with pytest.raises(ValueError, match="request_id 20 is already in use"):
        engine.add_request([1], one, request_id=20)
    drain(engine)
    assert engine.abort_request(20) is False
