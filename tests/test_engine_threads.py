"""One thread drives an engine: a call from a second thread while a call is in progress raises
RuntimeError (stream() iterators included); same-thread calls during a call, and calls from
another thread once the engine is idle, are fine."""

from __future__ import annotations

import threading

import pytest

from pyengine import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class Blocker:
    """A logits processor that holds the step (in the driving thread) until released."""

    def __init__(self) -> None:
        self.inside, self.release = threading.Event(), threading.Event()

    def __call__(self, token_ids, logits):
        self.inside.set()
        assert self.release.wait(30)
        return logits


def step_in_thread(engine: Engine, blocker: Blocker) -> tuple[threading.Thread, list]:
    errors: list = []

    def drive():
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    t = threading.Thread(target=drive, name="driver")
    t.start()
    assert blocker.inside.wait(30)
    return t, errors


@pytest.mark.parametrize("overlap", [False, True])
def test_a_second_thread_is_refused_while_a_step_runs(llama_dir, overlap):
    engine = Engine(llama_dir, seed=0, overlap=overlap)
    blocker = Blocker()
    engine.add_request([5, 6, 7], SamplingParams(**{**GREEDY.__dict__, "logits_processors": [blocker]}))
    t, errors = step_in_thread(engine, blocker)
    calls = {"step": engine.step, "add_request": lambda: engine.add_request([1, 2, 3], GREEDY),
             "abort_request": lambda: engine.abort_request(0), "stats": engine.stats,
             "has_unfinished_requests": engine.has_unfinished_requests, "shutdown": engine.shutdown,
             "generate": lambda: engine.generate([[1, 2]], GREEDY, use_tqdm=False)}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"Engine\.{name}\(\) was called from thread 'MainThread' while "
                                               r"another thread is inside Engine\.step\(\): one thread drives"):
            call()
    assert engine.stats.__wrapped__(engine)["num_requests"] == 1  # nothing was added behind its back
    blocker.release.set()
    t.join(30)
    assert not errors
    # idle now: another thread (this one) may drive it
    out = engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert len(out[0].token_ids) == 6
    engine.shutdown()


def test_a_stream_iterator_advanced_from_a_second_thread_is_refused(llama_dir):
    engine = Engine(llama_dir, seed=0)
    blocker = Blocker()
    stream = engine.stream([4, 5, 6], GREEDY)
    first = next(stream)  # the stream's request is running
    engine.add_request([5, 6, 7], SamplingParams(**{**GREEDY.__dict__, "logits_processors": [blocker]}))
    t, errors = step_in_thread(engine, blocker)
    with pytest.raises(RuntimeError, match=r"Engine\.step\(\) was called from thread 'MainThread'"):
        next(stream)
    blocker.release.set()
    t.join(30)
    assert not errors
    # the refused next() left the stream usable: it continues to the request's final output
    # (the driver thread stepped the engine meanwhile; the outputs waited in the stream's queue)
    outs = [first, *stream]
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 6
    engine.check_resources()
    engine.shutdown()


def test_calls_from_the_driving_thread_during_a_step_are_allowed(llama_dir):
    """A logits processor runs inside step() on the driving thread; it may abort a request."""
    engine = Engine(llama_dir, seed=0)
    victim = engine.add_request([8, 9, 10], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))

    def abort_victim(token_ids, logits):
        if len(token_ids) == 2:
            assert engine.abort_request(victim)
        return logits

    engine.add_request([1, 2], SamplingParams(**{**GREEDY.__dict__, "logits_processors": [abort_victim]}))
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o.finish_reason
    assert finals[victim] == "abort"
    engine.check_resources()
    engine.shutdown()
