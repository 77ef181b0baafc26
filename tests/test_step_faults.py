"""Every path through step() either completes or leaves the engine as before the step, plain
and overlap, for an exception or a Ctrl-C at any phase: the batch manager's schedule (faults
injected inside BatchManager::schedule), the sampler rows, the forward (the worker thread's,
with overlap), the sampler, the update and the outputs. Continuing always gives the outputs of
a run without the fault."""

from __future__ import annotations

import gc
import signal
import threading
import time

import pytest

from soak_ops import _frozen, logprobs_close
from test_atomic_step import PROMPTS, Injected, params, snapshot

from pyengine import Engine, KvCacheConfig, SchedulerConfig

SCHEDULE_POINTS = ["schedule.aborted", "schedule.capacity", "schedule.paused", "schedule.admitted",
                   "schedule.prepared", "schedule.filled"]


def make_engine(model_dir, overlap: bool) -> Engine:
    return Engine(model_dir, max_seq_len=104, seed=0, overlap=overlap,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=160),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=24,
                                                   capacity_scheduler_policy="max_utilization"))


def interrupt() -> None:
    """A real Ctrl-C: SIGINT to this process (Python runs its handler in the main thread)."""
    signal.raise_signal(signal.SIGINT)  # delivered to this thread now (a kill() may reach another thread, later)


class Fault:
    """Arms one fault for the next step. `undone`: the step is undone (else it completes and
    the interrupt is raised after it)."""

    raises: type[BaseException] = Injected
    undone = True

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.fired = False

    def wrap(self, owner, name: str, action, after: bool = False) -> None:
        """Patches owner.name so that its next call runs action() first (or, `after`, once the
        call has returned), once."""
        original = getattr(owner, name)

        def patched(*args, **kwargs):
            setattr(owner, name, original)
            self.fired = True
            if not after:
                action()
            result = original(*args, **kwargs)
            if after:
                action()
            return result
        setattr(owner, name, patched)


class ScheduleFault(Fault):
    raises = RuntimeError

    def __init__(self, engine: Engine, point: str) -> None:
        super().__init__(engine)
        self.point = point

    def arm(self) -> None:
        self.engine._bm._inject_fault(self.point)
        self.fired = True


class RowsFault(Fault):
    def arm(self) -> None:
        self.wrap(self.engine._loop, "_assign_sampler_rows", self._raise)

    def _raise(self):
        raise Injected("sampler rows failed")


class CtrlC(Fault):
    raises = KeyboardInterrupt

    def __init__(self, engine: Engine, phase: str) -> None:
        super().__init__(engine)
        self.phase = phase
        self.undone = phase.split(":")[0] in ("rows", "forward", "sample")

    def arm(self) -> None:
        loop = self.engine._loop
        name, _, when = self.phase.partition(":")  # "update:after": once the update has run
        owner, attr = {"rows": (loop, "_assign_sampler_rows"), "forward": (loop.runner, "forward"),
                       "sample": (loop.sampler, "sample"), "update": (loop, "_update"),
                       "respond": (loop, "_respond")}[name]
        self.wrap(owner, attr, interrupt, after=when == "after")


class SlowForwardCtrlC(Fault):
    """Overlap: Ctrl-C reaches the caller while the worker thread is still inside the forward.
    The undo must wait for the worker before it touches the buffers the forward reads."""

    raises = KeyboardInterrupt

    def arm(self) -> None:
        self.worker_done = threading.Event()
        runner = self.engine._loop.runner
        original = runner.forward

        def slow(*args, **kwargs):
            runner.forward = original
            self.fired = True
            interrupt()
            time.sleep(0.3)  # still in the forward when the caller's wait is interrupted
            try:
                return original(*args, **kwargs)
            finally:
                self.worker_done.set()
        runner.forward = slow


def run(engine: Engine, fail_at: int, make_fault) -> dict[int, object]:
    """Runs the PROMPTS; at step `fail_at` (and again each step until it fires) arms the fault.
    Checks the state after the faulty step; returns the final outputs."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params())]
    finals, step, fault = {}, 0, None
    while engine.has_unfinished_requests():
        if step >= fail_at and (fault is None or not fault.fired):
            fault = make_fault(engine)
            before = snapshot(engine)
            fault.arm()
            try:
                outs = engine.step()
            except fault.raises:
                outs = None
            if not fault.fired:  # nothing reached that phase this step (no rows assigned, say)
                assert outs is not None
            else:
                assert outs is None, "the fault did not reach the caller"
                if isinstance(fault, SlowForwardCtrlC):
                    assert fault.worker_done.is_set(), "the step was undone while the forward still ran"
                engine._bm.check_invariants()
                if fault.undone and not engine.overlap:
                    after = snapshot(engine)
                    for key in set(engine._bm.events()["paused"]):  # pauses stand: recomputed later
                        before.pop(key, None), after.pop(key, None)
                    if engine._bm.events()["paused"]:
                        before.pop("stats"), after.pop("stats"), before.pop("sampler"), after.pop("sampler")
                    assert after == before
                continue
        else:
            outs = engine.step()
        finals.update((o.request_id, o) for o in outs if o.finished)
        step += 1
    assert fault is not None and fault.fired
    engine.check_resources()
    return {i: (finals[rid].token_ids, finals[rid].logprobs, finals[rid].prompt_logprobs) for i, rid in enumerate(ids)}


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """The Ctrl-Cs here stand for an application with Python's SIGINT handler (KeyboardInterrupt).
    A process started with SIGINT ignored -- a background job of a non-interactive shell -- inherits
    SIG_IGN, which the engine leaves alone and under which a Ctrl-C does nothing: the tests install
    the handler rather than depend on how pytest was started (as soak_ops.run_soak does)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def reference(llama_dir):
    eng = make_engine(llama_dir, overlap=False)
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params())]
    finals = {}
    while eng.has_unfinished_requests():
        finals.update((o.request_id, o) for o in eng.step() if o.finished)
    return {i: (finals[rid].token_ids, finals[rid].logprobs, finals[rid].prompt_logprobs) for i, rid in enumerate(ids)}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("point", SCHEDULE_POINTS)
@pytest.mark.parametrize("fail_at", [0, 7])
def test_a_fault_inside_the_schedule(llama_dir, reference, overlap, point, fail_at):
    engine = make_engine(llama_dir, overlap)
    assert run(engine, fail_at, lambda e: ScheduleFault(e, point)) == reference


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fail_at", [0, 4])
def test_a_fault_while_assigning_sampler_rows(llama_dir, reference, overlap, fail_at):
    engine = make_engine(llama_dir, overlap)
    assert run(engine, fail_at, RowsFault) == reference


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("phase", ["rows", "rows:after", "forward", "forward:after", "sample", "sample:after",
                                   "update", "update:after", "respond", "respond:after"])
@pytest.mark.parametrize("fail_at", [1, 9])
def test_ctrl_c_at_every_phase(llama_dir, reference, overlap, phase, fail_at):
    engine = make_engine(llama_dir, overlap)
    assert run(engine, fail_at, lambda e: CtrlC(e, phase)) == reference
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the gate put it back


@pytest.fixture
def no_collection_during_the_step():
    """Python runs a signal's handler at the next bytecode boundary of the main thread; if that
    is inside a weakref callback or finalizer of garbage collected meanwhile (an earlier test's
    engine threads: threading's WeakSet), the KeyboardInterrupt is printed as "Exception
    ignored" and lost -- CPython's rule, not the engine's. The earlier tests' garbage goes
    first, and no collection runs while the Ctrl-C is pending."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("fail_at", [1, 6])
def test_ctrl_c_while_the_worker_is_still_in_the_forward(llama_dir, reference, fail_at,
                                                         no_collection_during_the_step):
    engine = make_engine(llama_dir, overlap=True)
    assert run(engine, fail_at, SlowForwardCtrlC) == reference


def test_an_application_sigint_handler_runs_where_the_interrupt_is_let_through(llama_dir, reference):
    """A handler that does not raise: the step that held the signal back completes and returns
    its outputs; the handler ran once."""
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        engine = make_engine(llama_dir, overlap=False)
        ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params())]
        finals, step = {}, 0
        while engine.has_unfinished_requests():
            if step == 3:
                CtrlC(engine, "update").arm()
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
            step += 1
        assert calls == [signal.SIGINT]
        got = {i: (finals[rid].token_ids, finals[rid].logprobs, finals[rid].prompt_logprobs)
               for i, rid in enumerate(ids)}
        assert got == reference
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_held_during_a_step_that_then_fails_is_not_lost(llama_dir, reference):
    """Overlap: a Ctrl-C arrives while the previous step's update runs (held back), then the
    schedule fails. The caller gets the KeyboardInterrupt (the failure as its context), and
    the run continues to the same outputs."""
    engine = make_engine(llama_dir, overlap=True)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params())]
    for _ in range(3):
        engine.step()
    CtrlC(engine, "update").arm()
    engine._bm._inject_fault("schedule.admitted")
    with pytest.raises(KeyboardInterrupt) as info:
        engine.step()
    assert "injected fault at schedule.admitted" in str(info.value.__context__)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.check_resources()
    got = {i: (finals[rid].token_ids, finals[rid].logprobs, finals[rid].prompt_logprobs) for i, rid in enumerate(ids)}
    assert got == reference


class BrokenDetokenizer(RuntimeError):
    pass


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("victim, at_token", [(0, 3), (2, 1), (3, 27)])  # 3: its last token (max_tokens 28)
def test_an_output_that_fails_to_build_ends_its_request_only(llama_dir, reference, overlap, victim, at_token):
    """The step is committed when outputs are built: a request whose output fails (here its
    detokenizer raises) ends with finish_reason "abort"; the error reaches the caller once the
    step is complete, and every other request finishes exactly as without the fault."""
    engine = make_engine(llama_dir, overlap)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params())]
    state = {"armed": True}

    def watch(outs):
        rec = engine._requests.records.get(engine._requests.core_id(ids[victim]))
        if state["armed"] and rec is not None and len(rec.token_ids) == at_token - 1 and \
                not hasattr(rec.detokenizer, "_patched"):
            original = rec.detokenizer.add

            def broken(*args, **kwargs):
                if state["armed"]:
                    state["armed"] = False
                    raise BrokenDetokenizer("detokenizer failed")
                return original(*args, **kwargs)
            rec.detokenizer.add = broken
            rec.detokenizer._patched = True

    finals, raised = {}, 0
    watch(None)
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except BrokenDetokenizer:
            raised += 1
            engine.check_resources()
            continue
        for o in outs:
            assert o.request_id not in finals, "an output after the final one"
            if o.finished:
                finals[o.request_id] = o
        watch(outs)
    assert raised == 1 and not state["armed"]
    engine.check_resources()
    final = finals[ids[victim]]
    if overlap:  # the next step, already in flight, may still give it a token (and end it by length)
        assert final.finish_reason in ("abort", "length") and len(final.token_ids) in (at_token, at_token + 1)
    else:
        assert final.finish_reason == "abort" and len(final.token_ids) == at_token
    for i, rid in enumerate(ids):
        if i != victim:  # (the batches change shape without the victim: logprobs to 4 decimals)
            tokens, logprobs, prompt_logprobs = reference[i]
            assert finals[rid].token_ids == tokens
            assert logprobs_close(_frozen(finals[rid].logprobs), _frozen(logprobs))
            assert logprobs_close(_frozen(finals[rid].prompt_logprobs), _frozen(prompt_logprobs))
