"""An atomic step(): a failure in the forward, the sampler or a user's logits processor
leaves the engine as it was before the step, and continuing gives the same outputs."""

from __future__ import annotations

import pytest

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

PROMPTS = [list(range(10, 70)), [5, 9, 44, 71, 100, 3, 8], [300, 12, 17] * 9, [42] * 25, list(range(200, 240))]


class Injected(RuntimeError):
    pass


def make_engine(model_dir) -> Engine:
    # a small pool and token budget: chunked prefill and max-utilization pauses in the mix
    return Engine(model_dir, max_seq_len=104, seed=0,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=160),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=24,
                                                   capacity_scheduler_policy="max_utilization"))


def params(processor=None) -> list[SamplingParams]:
    ps = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=24, ignore_eos=True,
                         repetition_penalty=1.2, logprobs=2),
          SamplingParams(temperature=0.7, seed=2, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
          SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True, presence_penalty=0.3),
          SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, min_p=0.05)]
    if processor is not None:
        ps[1] = SamplingParams(**{**ps[1].__dict__, "logits_processors": [processor]})
    return ps


def snapshot(engine: Engine) -> dict:
    # Reusable (cached, free) blocks the failed step evicted stay evicted: their memory may
    # have been overwritten by the failed forward. Everything else is restored exactly.
    stats = engine.stats()
    stats.pop("num_reusable_blocks")
    state = {"stats": stats}
    for rid, rec in engine._requests.records.items():
        m = engine._bm.request_metrics(rid)
        m.pop("arrival_time")
        state[rid] = (m, list(rec.token_ids), engine._bm.block_table(rid)
                      if m["seq_slot"] >= 0 else None)
    sampler = engine._sampler
    state["sampler"] = (dict(sampler._active), sampler.num_generated.tolist(), sampler.counts.sum(1).tolist())
    return state


def run(engine: Engine, fail_at: int | None = None, inject=None) -> dict[int, object]:
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params(inject.processor if inject else None))]
    finals, step, failed = {}, 0, False
    while engine.has_unfinished_requests():
        if step == fail_at and not failed:
            before = snapshot(engine)
            inject.arm()
            with pytest.raises(Injected):
                engine.step()
            failed = True
            after = snapshot(engine)
            paused = set(engine._bm.events()["paused"])
            if paused:  # pauses stand (the failed forward may have written into their blocks):
                for state in (before, after):  # those requests are recomputed, outputs unchanged
                    for key in ("stats", "sampler", *paused):
                        state.pop(key, None)
            assert after == before
            engine.check_resources()
            continue
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
        step += 1
    assert failed or fail_at is None
    return {i: (finals[rid].token_ids, finals[rid].logprobs, finals[rid].prompt_logprobs) for i, rid in enumerate(ids)}


class ForwardFailure:
    processor = None

    def __init__(self, engine: Engine) -> None:
        self.engine, self.original = engine, engine._runner.forward

    def arm(self) -> None:
        def failing(*args, **kwargs):
            self.engine._runner.forward = self.original
            self.original(*args, **kwargs)  # the KV writes happen, then it fails
            raise Injected("forward failed")
        self.engine._runner.forward = failing


class SamplerFailure:
    processor = None

    def __init__(self, engine: Engine) -> None:
        self.engine, self.original = engine, engine._sampler.sample

    def arm(self) -> None:
        def failing(*args, **kwargs):
            self.engine._sampler.sample = self.original
            raise Injected("sampler failed")
        self.engine._sampler.sample = failing


class ProcessorFailure:
    def __init__(self, engine: Engine) -> None:
        self.armed = False

    def processor(self, token_ids, logits):
        if self.armed:
            self.armed = False
            raise Injected("logits processor failed")
        logits[7] -= 1.0  # a real change, so the processor matters to the outputs
        return logits

    def arm(self) -> None:
        self.armed = True


@pytest.fixture(scope="module")
def reference(llama_dir):
    return run(make_engine(llama_dir))


@pytest.mark.parametrize("fail_at", [0, 3, 9, 20])
@pytest.mark.parametrize("kind", [ForwardFailure, SamplerFailure])
def test_failure_leaves_the_engine_as_before(llama_dir, reference, kind, fail_at):
    engine = make_engine(llama_dir)
    got = run(engine, fail_at, kind(engine))
    assert got == reference
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.parametrize("fail_at", [2, 12])
def test_failing_logits_processor(llama_dir, fail_at):
    reference_engine = make_engine(llama_dir)
    expected = run(reference_engine, None, ProcessorFailure(reference_engine))
    engine = make_engine(llama_dir)
    got = run(engine, fail_at, ProcessorFailure(engine))
    assert got == expected


def test_an_abort_before_a_failed_step_is_delivered_by_the_next_one(llama_dir):
    engine = make_engine(llama_dir)
    a = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5))
    b = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5))
    engine.step()
    engine.abort_request(a)
    inject = ForwardFailure(engine)
    inject.arm()
    with pytest.raises(Injected):
        engine.step()
    assert engine.has_unfinished_requests()
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [(a, "abort")]
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine._bm.contains(b)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_step_that_paused_a_request_without_a_seat(llama_dir, overlap):
    """Under max_utilization a request admitted but never batched (no seat yet) can be
    paused; when that step fails, undoing it must not touch a sampler row for it (there is
    none). Found by the soak (tests/test_soak.py)."""
    def engine() -> Engine:
        return Engine(llama_dir, max_seq_len=40, seed=0, overlap=overlap,
                      kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=40, free_memory_fraction=None),
                      scheduler_config=SchedulerConfig(max_batch_size=2, max_num_tokens=16,
                                                       capacity_scheduler_policy="max_utilization"))

    requests = [(list(range(100, 132)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
                (list(range(200, 208)), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))]
    # The call whose schedule pauses b: a's prompt takes every token of the first steps, so b,
    # admitted with it, has no seat yet; then a's blocks crowd b out.
    probe = engine()
    a, b = (probe.add_request(p, sp) for p, sp in requests)
    calls = 0
    while probe._bm.request_metrics(b)["num_pauses"] == 0:
        assert probe._bm.request_metrics(b)["seq_slot"] < 0
        probe.step()
        calls += 1
    while probe.has_unfinished_requests():
        probe.step()

    eng = engine()
    ids = [eng.add_request(p, sp) for p, sp in requests]
    for _ in range(calls - 1):
        eng.step()
    inject = ForwardFailure(eng)
    inject.arm()
    with pytest.raises(Injected):
        eng.step()
    eng.check_resources()
    finals = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    reference = engine()
    want = reference.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
    assert [finals[i].token_ids for i in ids] == [w.token_ids for w in want]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_paused_by_a_failed_step_is_recomputed(llama_dir, overlap):
    """A step pauses a request (its blocks go to an earlier one), the forward writes into
    them, then a logits processor fails. Had the rollback given the paused request its blocks
    back, it would decode on a corrupted KV whenever the retried step does not pause it again
    (here: an abort frees room first). The pause stands: it is recomputed, outputs unchanged.
    Found by the soak (tests/test_soak.py)."""
    def engine(blocks: int) -> Engine:
        return Engine(llama_dir, max_seq_len=64, seed=0, overlap=overlap,
                      kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=blocks * 8,
                                                    free_memory_fraction=None, enable_block_reuse=False),
                      scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=32,
                                                       capacity_scheduler_policy="max_utilization"))

    prompts = [list(range(100, 113)), list(range(200, 215)), list(range(300, 311)), list(range(400, 409))]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [engine(64).generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
    eng = engine(8)
    state = {"armed": True, "paused": []}

    def fail_when_a_seated_request_is_paused(ids, row):
        ev = eng._bm.events()
        if state["armed"] and any(slot >= 0 for slot in ev["paused_slots"]):
            state["armed"], state["paused"] = False, list(ev["paused"])
            raise Injected("logits processor failed")
        return row

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            logits_processors=[fail_when_a_seated_request_is_paused])
    ids = [eng.add_request(p, params) for p in prompts]
    finals = {}
    while eng.has_unfinished_requests():
        try:
            outs = eng.step()
        except Injected:
            eng.check_resources()
            eng.abort_request(next(i for i in reversed(ids) if i not in state["paused"] and i not in finals))
            continue
        finals.update((o.request_id, o) for o in outs if o.finished)
    assert state["paused"] and not state["armed"]
    kept = [i for i, rid in enumerate(ids) if finals[rid].finish_reason != "abort"]
    assert len(kept) == 3 and all(finals[ids[i]].token_ids == alone[i] for i in kept)
