"""A randomized soak through the public API, shared by tests/test_soak.py (CI-sized) and
bench/soak.py (long runs).

One random operation at a time — add a request (random prompt and SamplingParams: greedy
or seeded sampling only, so outputs are reproducible), abort one (no output yet, streaming,
just finished, finished earlier, never seen), step(), arm an injected fault (the runner's
forward or a user's logits processor raises once, the batch manager's schedule throws at one
of its points, or a real Ctrl-C arrives during the forward, the sampler, the update or the
outputs; a failed step must change nothing, an interrupted one is undone or completes, and
the next one continues), or an invalid add_request (ValueError, nothing changes) — applied
in lockstep to one engine per mode (overlap off, on) over a small KV pool under
max_utilization with chunked prefill. The first engine's public state drives the random
choices; every engine gets the same operation.

Checked in every engine, after each operation: each output extends the request's previous
one (tokens, text, one logprob entry per token); every request gets exactly one final
output and nothing after it; an accepted abort's final output comes with the next step
that succeeds, a refused one only for a request already finished; a failed step raises
only the injected fault; engine.check_resources() holds after every step and, at the end,
every block and seat is back. Across engines, when a request has finished in all of them:
tokens, finish reason, text, stop reason equal, logprobs and prompt logprobs equal to 4
decimals (batches of other shapes round the last float bits differently; see logprobs_close),
unless the tokens part where the sampler's choice hangs on a near-tie (TieCheck);
for a request that some engine aborted, the shorter token list must be a prefix of the
longer (and the logprobs likewise).
"""

from __future__ import annotations

import random
import signal
import traceback
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

# Strings the tiny checkpoints' byte-level BPE produces often: stop strings that do hit.
STOP_STRINGS = ["e", "a", "o", "in", "re", "ing", "ed", " t", "s ", ".", "low", "ck", "er", "th"]
SALTS = [None, None, "salt-a", "salt-b"]
ABORT_KINDS = ("no_output", "streaming", "just_finished", "finished", "unknown")
FAULTS = ("forward", "processor", "schedule", "interrupt")
SCHEDULE_FAULT_POINTS = ("schedule.aborted", "schedule.capacity", "schedule.paused", "schedule.admitted",
                         "schedule.prepared", "schedule.filled")
INTERRUPT_PHASES = ("forward", "sample", "update", "respond")
BAD_ADDS = ("empty_prompt", "token_outside_vocab", "too_long", "stop_token_outside_vocab")


class Injected(RuntimeError):
    """The soak's injected fault."""


class SoakFailure(AssertionError):
    pass


@dataclass(frozen=True)
class SoakConfig:
    max_seq_len: int = 96
    tokens_per_block: int = 8
    pool_tokens: int = 192            # 24 blocks: max_utilization pauses often
    max_batch_size: int = 4
    max_num_tokens: int = 24          # long prompts prefill in chunks
    queue_policy: str = "priority"
    enable_block_reuse: bool = True
    max_live: int = 12                # unfinished requests the generator keeps at most
    max_prompt: int = 60
    max_new: int = 40


def make_engine(model_dir: str | Path, overlap: bool, cfg: SoakConfig, seed: int) -> Engine:
    return Engine(model_dir, max_seq_len=cfg.max_seq_len, seed=seed, overlap=overlap,
                  kv_cache_config=KvCacheConfig(tokens_per_block=cfg.tokens_per_block, max_tokens=cfg.pool_tokens,
                                                free_memory_fraction=None,
                                                enable_block_reuse=cfg.enable_block_reuse),
                  scheduler_config=SchedulerConfig(max_batch_size=cfg.max_batch_size,
                                                   max_num_tokens=cfg.max_num_tokens, enable_chunked_prefill=True,
                                                   capacity_scheduler_policy="max_utilization",
                                                   queue_policy=cfg.queue_policy))


# ---- operations -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """An add_request as plain data (each engine builds its own SamplingParams from it: the
    logits processors are bound to that engine's fault injector)."""

    prompt: tuple[int, ...]
    params: tuple[tuple[str, Any], ...]
    priority: float
    salt: str | None
    processor: str | None             # None, "hook" (identity) or "ban" (masks one token)
    ban: int = 0


@dataclass(frozen=True)
class Op:
    kind: str                          # "add" | "abort" | "step" | "fault" | "bad_add"
    spec: RequestSpec | None = None    # add
    target: int = -1                   # abort: request index (-1: an id never used)
    abort_kind: str = ""               # abort: what the driving engine's view said
    what: str = ""                     # fault: "forward" | "processor"; bad_add: which


@dataclass
class View:
    """The driving engine's public state, by request index."""

    no_output: list[int]
    streaming: list[int]
    just_finished: list[int]
    finished: list[int]
    num_unfinished: int


class OpGenerator:
    """Random operations from a seed; the choice of abort target reads a View."""

    def __init__(self, seed: int, cfg: SoakConfig, vocab_size: int) -> None:
        self.rng = random.Random(seed)
        self.cfg = cfg
        self.vocab = vocab_size
        self.num_added = 0
        # shared prefixes (prefix reuse across requests, with and without salts)
        self.prefixes = [[self.rng.randrange(3, vocab_size) for _ in range(n)] for n in (8, 16, 24, 33)]

    def next(self, view: View) -> Op:
        r = self.rng.random()
        if r < 0.03:
            what = self.rng.choice(FAULTS)
            if what == "schedule":
                what = f"schedule:{self.rng.choice(SCHEDULE_FAULT_POINTS)}"
            elif what == "interrupt":
                what = f"interrupt:{self.rng.choice(INTERRUPT_PHASES)}"
            return Op("fault", what=what)
        if r < 0.045:
            return Op("bad_add", what=self.rng.choice(BAD_ADDS))
        if r < 0.13:
            return self._abort(view)
        if r < 0.50 and view.num_unfinished < self.cfg.max_live:
            self.num_added += 1
            return Op("add", spec=self._spec())
        return Op("step")

    def _abort(self, view: View) -> Op:
        kinds = [k for k in ABORT_KINDS if k == "unknown" or getattr(view, k)]
        weights = [{"no_output": 3, "streaming": 4, "just_finished": 4, "finished": 1, "unknown": 0.3}[k]
                   for k in kinds]
        kind = self.rng.choices(kinds, weights)[0]
        if kind == "unknown":
            return Op("abort", target=-1, abort_kind=kind)
        pool = getattr(view, kind)
        # no output yet: the oldest is likely prefilling (chunks), the newest waiting
        target = self.rng.choice([pool[0], pool[-1]] if kind == "no_output" else pool)
        return Op("abort", target=target, abort_kind=kind)

    def _spec(self) -> RequestSpec:
        rng, cfg = self.rng, self.cfg
        n = rng.choice((1, 2, 3, 5, 8, 13)) if rng.random() < 0.4 else rng.randint(1, cfg.max_prompt)
        prompt = [rng.randrange(3, self.vocab) for _ in range(n)]
        if rng.random() < 0.3:
            prefix = rng.choice(self.prefixes)
            prompt = (prefix + prompt)[: max(cfg.max_prompt, len(prefix) + 1)]
        max_tokens = rng.randint(1, min(cfg.max_new, cfg.max_seq_len - len(prompt)))
        p: dict[str, Any] = {"max_tokens": max_tokens}
        if rng.random() < 0.5:
            p["temperature"] = 0.0
        else:  # seeded: the same tokens whatever the batch, and after a pause
            p["temperature"] = round(rng.uniform(0.3, 1.5), 3)
            p["seed"] = rng.randrange(2**31)
            if rng.random() < 0.4:
                p["top_k"] = rng.randint(1, 60)
            if rng.random() < 0.4:
                p["top_p"] = round(rng.uniform(0.3, 1.0), 3)
            if rng.random() < 0.3:
                p["min_p"] = round(rng.uniform(0.0, 0.3), 3)
        if rng.random() < 0.25:
            p["repetition_penalty"] = round(rng.uniform(0.7, 1.6), 3)
        if rng.random() < 0.2:
            p["presence_penalty"] = round(rng.uniform(-1, 1), 3)
        if rng.random() < 0.2:
            p["frequency_penalty"] = round(rng.uniform(-1, 1), 3)
        if rng.random() < 0.2:
            p["min_tokens"] = rng.randint(0, max_tokens)
        if rng.random() < 0.4:
            p["stop"] = rng.sample(STOP_STRINGS, rng.randint(1, 2))
            p["include_stop_str_in_output"] = rng.random() < 0.3
        if rng.random() < 0.25:
            p["stop_token_ids"] = [rng.randrange(3, self.vocab) for _ in range(rng.randint(1, 6))]
        p["ignore_eos"] = rng.random() < 0.5
        if rng.random() < 0.4:
            p["logprobs"] = rng.randint(0, 4)
        if rng.random() < 0.1:
            p["prompt_logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.1:
            p["skip_special_tokens"] = False
        processor = rng.choice((None, None, None, None, None, "hook", "ban"))
        return RequestSpec(prompt=tuple(prompt), params=tuple(sorted(p.items())),
                           priority=round(rng.random(), 3), salt=rng.choice(SALTS), processor=processor,
                           ban=rng.randrange(3, self.vocab))


# ---- one engine ------------------------------------------------------------------------------


class FaultInjector:
    """Arms a one-shot fault: the runner's forward or the next call of a soak logits processor
    raises Injected; the batch manager's schedule throws at a point ("schedule:<point>",
    BatchManager::inject_fault); or a real Ctrl-C (SIGINT) arrives during a phase of the step
    ("interrupt:<phase>"). Counts the faults that fired, by kind."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.armed: dict[str, bool] = defaultdict(bool)
        self.fired: Counter = Counter()
        loop = engine._loop
        self._wrap(engine._runner, "forward", "forward")
        for phase, (owner, name) in {"forward": (engine._runner, "forward"), "sample": (engine._sampler, "sample"),
                                     "update": (loop, "_update"), "respond": (loop, "_respond")}.items():
            self._wrap(owner, name, f"interrupt:{phase}")

    def _wrap(self, owner, name: str, what: str) -> None:
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self._maybe_fire(what)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)

    def arm(self, what: str) -> None:
        if what.startswith("schedule:"):  # fires in the next step's schedule (every step has one)
            self.engine._bm._inject_fault(what.partition(":")[2])
            self.armed["schedule"] = True
        else:
            self.armed[what] = True

    def _maybe_fire(self, what: str) -> None:
        if self.armed[what]:
            self.armed[what] = False
            kind = what.partition(":")[0]
            self.fired[kind] += 1
            if kind == "interrupt":
                signal.raise_signal(signal.SIGINT)  # synchronous; raised where the step lets it through
            else:
                raise Injected(f"injected {what} failure")

    def processor(self, kind: str, ban: int) -> Callable:
        def hook(ids, row):
            self._maybe_fire("processor")
            return row

        def ban_token(ids, row):
            self._maybe_fire("processor")
            row[ban] = float("-inf")
            return row

        return hook if kind == "hook" else ban_token


LOGPROB_TOLERANCE = 1e-4


def _frozen(lps) -> tuple | None:
    if lps is None:
        return None
    return tuple(None if d is None else tuple(sorted(d.items())) for d in lps)


def logprobs_close(a: tuple | None, b: tuple | None) -> bool:
    """Equal to 4 decimals: the same tokens, values within 1e-4. (Rounding both to 4
    decimals and comparing, as tests/test_overlap.py does, fails now and then over
    thousands of requests: a difference of a few float32 ulps straddles a rounding
    boundary, e.g. -2.74575001 vs -2.74574995.)"""
    if a is None or b is None:
        return a is b
    if len(a) != len(b):
        return False
    for da, db in zip(a, b):
        if da is None or db is None:
            if da is not db:
                return False
            continue
        if [t for t, _ in da] != [t for t, _ in db]:
            return False
        if any(abs(va - vb) > LOGPROB_TOLERANCE for (_, va), (_, vb) in zip(da, db)):
            return False
    return True


@dataclass
class Final:
    token_ids: tuple[int, ...]
    finish_reason: str
    text: str
    stop_reason: Any
    logprobs: tuple | None
    prompt_logprobs: tuple | None
    spec: RequestSpec


@dataclass
class Live:
    spec: RequestSpec
    params: SamplingParams
    rid: int
    num_tokens: int = 0
    text: str = ""
    outputs: int = 0


@dataclass
class Counts:
    ops: Counter = field(default_factory=Counter)
    steps: int = 0
    failed_steps: int = 0
    interrupted_steps: int = 0   # a Ctrl-C reached the caller from step()
    finished: Counter = field(default_factory=Counter)   # by finish reason
    aborts: Counter = field(default_factory=Counter)     # (view kind, accepted) -> n
    bad_adds: int = 0
    redecoded: int = 0   # final outputs whose exact decode differs from the streamed text


class SoakRun:
    """One engine under the soak: applies operations and checks its invariants."""

    def __init__(self, name: str, engine: Engine, cfg: SoakConfig) -> None:
        self.name, self.engine, self.cfg = name, engine, cfg
        self.faults = FaultInjector(engine)
        self.live: dict[int, Live] = {}           # request index -> live request
        self.by_rid: dict[int, int] = {}          # request id -> index, live requests
        self.finished_rids: dict[int, int] = {}   # request id -> index, the latest finished (bounded)
        self.new_finals: dict[int, Final] = {}    # finals not yet compared
        self.just_finished: list[int] = []
        self.recent_finished: deque[int] = deque(maxlen=32)
        self.abort_due: set[int] = set()          # accepted aborts: final due with the next good step
        self.num_added = 0
        self.counts = Counts()

    def fail(self, msg: str) -> None:
        raise SoakFailure(f"[{self.name}] {msg}")

    def view(self) -> View:
        no_output = [i for i, lv in self.live.items() if lv.outputs == 0]
        streaming = [i for i, lv in self.live.items() if lv.outputs > 0]
        return View(no_output, streaming, list(self.just_finished), list(self.recent_finished), len(self.live))

    # -- operations --

    def apply(self, op: Op) -> None:
        self.counts.ops[op.kind] += 1
        if op.kind == "step":
            self.step()
        elif op.kind == "add":
            self.add(op.spec)
        elif op.kind == "abort":
            self.abort(op)
        elif op.kind == "fault":
            self.faults.arm(op.what)
        elif op.kind == "bad_add":
            self.bad_add(op.what)
        else:
            raise ValueError(op.kind)

    def add(self, spec: RequestSpec) -> None:
        p = dict(spec.params)
        if spec.processor is not None:
            p["logits_processors"] = [self.faults.processor(spec.processor, spec.ban)]
        params = SamplingParams(**p)
        rid = self.engine.add_request(list(spec.prompt), params, priority=spec.priority, cache_salt=spec.salt)
        idx = self.num_added
        self.num_added += 1
        if rid in self.by_rid:
            self.fail(f"request id {rid} handed out twice")
        self.by_rid[rid] = idx
        self.finished_rids.pop(rid, None)  # (an id may be reused once its request finished)
        self.live[idx] = Live(spec, params, rid)

    def bad_add(self, what: str) -> None:
        vocab, cfg = self.engine.model_config.vocab_size, self.cfg
        before = self.engine.stats()
        prompt, params = [5, 6, 7], SamplingParams(max_tokens=4)
        if what == "empty_prompt":
            prompt = []
        elif what == "token_outside_vocab":
            prompt = [5, vocab + 3]
        elif what == "too_long":
            params = SamplingParams(max_tokens=cfg.max_seq_len)
        elif what == "stop_token_outside_vocab":
            params = SamplingParams(max_tokens=4, stop_token_ids=[vocab])
        try:
            self.engine.add_request(prompt, params)
        except ValueError:
            pass
        else:
            self.fail(f"bad add_request ({what}) was accepted")
        if self.engine.stats() != before:
            self.fail(f"a refused add_request ({what}) changed the engine")
        self.counts.bad_adds += 1

    def abort(self, op: Op) -> None:
        if op.target < 0:
            try:
                self.engine.abort_request(10**12 + op.target)
            except ValueError:
                self.counts.aborts[("unknown", "refused")] += 1
                return
            self.fail("abort_request of an id never seen did not raise")
        idx = op.target
        if idx in self.live:
            rid = self.live[idx].rid
        else:  # finished here: its id, if still remembered
            rid = next((r for r, i in self.finished_rids.items() if i == idx), None)
            if rid is None:
                self.counts.aborts[(op.abort_kind, "forgotten")] += 1
                return
        accepted = self.engine.abort_request(rid)
        self.counts.aborts[(op.abort_kind, "accepted" if accepted else "refused")] += 1
        if accepted and idx not in self.live:
            self.fail(f"abort of request {idx}, already finished, was accepted")
        # Accepted: its final output comes with the next step that succeeds. Refused while
        # we have not seen its final output: it has finished (or was aborted already), and
        # that final output is held for the next step that succeeds (after a failed step).
        if idx in self.live:
            self.abort_due.add(idx)

    def step(self) -> bool:
        engine = self.engine
        fired = sum(self.faults.fired.values())
        if self.faults.armed["schedule"]:
            self.faults.armed["schedule"] = False
            self.faults.fired["schedule"] += 1
        try:
            outs = engine.step()
        except (Injected, RuntimeError, KeyboardInterrupt) as e:
            if isinstance(e, RuntimeError) and not isinstance(e, Injected) and "injected fault at schedule." not in str(e):
                raise
            # A KeyboardInterrupt: the step was undone (forward, sampler), or it completed and
            # its outputs come with the next step. Several faults may fire in one step (Ctrl-Cs
            # coalesce, as signals do); none fires unseen.
            if sum(self.faults.fired.values()) == fired:
                self.fail(f"step() raised {type(e).__name__} but no injected fault fired: {e}")
            if isinstance(e, KeyboardInterrupt):
                self.counts.interrupted_steps += 1
            else:
                self.counts.failed_steps += 1
            engine.check_resources()
            return False
        if sum(self.faults.fired.values()) != fired:
            self.fail(f"a fault fired ({self.faults.fired}) but step() succeeded")
        self.counts.steps += 1
        self.just_finished = []
        for o in outs:  # with overlap a request may get two (a token, then its abort)
            self.on_output(o)
        missing = [i for i in self.abort_due if i in self.live]
        if missing:
            self.fail(f"aborted requests {missing} got no final output from the next step that succeeded")
        self.abort_due.clear()
        engine.check_resources()
        return True

    def on_output(self, o) -> None:
        idx = self.by_rid.get(o.request_id)
        if idx is None:
            if o.request_id in self.finished_rids:
                self.fail(f"request {self.finished_rids[o.request_id]} got an output after its final one: "
                          f"{o.finish_reason}")
            self.fail(f"output for unknown request id {o.request_id}")
        lv = self.live[idx]
        sp = lv.params
        lv.outputs += 1
        if len(o.token_ids) != lv.num_tokens + len(o.new_token_ids) or \
                list(o.token_ids[lv.num_tokens:]) != list(o.new_token_ids):
            self.fail(f"request {idx}: token_ids {len(o.token_ids)} do not extend {lv.num_tokens} "
                      f"by new_token_ids {o.new_token_ids}")
        lv.num_tokens = len(o.token_ids)
        if len(o.token_ids) > sp.max_tokens:
            self.fail(f"request {idx}: {len(o.token_ids)} tokens > max_tokens {sp.max_tokens}")
        if sp.logprobs is None:
            if o.logprobs is not None:
                self.fail(f"request {idx}: logprobs without asking")
        elif len(o.logprobs) != len(o.token_ids):
            self.fail(f"request {idx}: {len(o.logprobs)} logprob entries for {len(o.token_ids)} tokens")
        if not o.text.startswith(lv.text) or o.new_text != o.text[len(lv.text):]:
            # The last output is the exact decode of every token, which for invalid byte
            # sequences may differ from the incremental text (pyengine/detokenizer.py).
            exact = self.engine.tokenizer.decode(o.token_ids, skip_special_tokens=sp.skip_special_tokens)
            if not (o.finished and not isinstance(o.stop_reason, str) and o.text == exact and o.new_text == ""):
                self.fail(f"request {idx}: text {o.text!r} (new {o.new_text!r}) does not extend {lv.text!r} "
                          f"({dict(lv.spec.params)}, prompt {lv.spec.prompt}, tokens {o.token_ids}, "
                          f"{o.finish_reason} {o.stop_reason!r}, exact decode {exact!r})")
            self.counts.redecoded += 1
        lv.text = o.text
        if not o.finished:
            if o.finish_reason is not None:
                self.fail(f"request {idx}: finish_reason {o.finish_reason} on an unfinished output")
            return
        reason = o.finish_reason
        if reason not in ("stop", "length", "abort"):
            self.fail(f"request {idx}: finish_reason {reason!r}")
        if reason == "length" and len(o.token_ids) != sp.max_tokens:
            self.fail(f"request {idx}: length with {len(o.token_ids)} of {sp.max_tokens} tokens")
        if reason == "abort" and o.new_token_ids:
            self.fail(f"request {idx}: an abort output with new tokens")
        if reason == "stop":
            if len(o.token_ids) < sp.min_tokens:
                self.fail(f"request {idx}: stopped at {len(o.token_ids)} < min_tokens {sp.min_tokens}")
            if isinstance(o.stop_reason, str):
                if o.stop_reason not in sp.stop:
                    self.fail(f"request {idx}: stop_reason {o.stop_reason!r} not in {sp.stop}")
            elif o.stop_reason != o.token_ids[-1]:
                self.fail(f"request {idx}: stop_reason {o.stop_reason!r} is not the last token")
        if sp.prompt_logprobs is not None and reason != "abort" and len(o.prompt_logprobs) != len(lv.spec.prompt):
            self.fail(f"request {idx}: {len(o.prompt_logprobs)} prompt logprobs for {len(lv.spec.prompt)} tokens")
        del self.live[idx]
        del self.by_rid[o.request_id]
        self.finished_rids[o.request_id] = idx  # a while: aborts of finished requests, late outputs
        if len(self.finished_rids) > 256:
            del self.finished_rids[next(iter(self.finished_rids))]
        self.just_finished.append(idx)
        self.recent_finished.append(idx)
        self.counts.finished[reason] += 1
        self.new_finals[idx] = Final(tuple(o.token_ids), reason, o.text, o.stop_reason, _frozen(o.logprobs),
                                     _frozen(o.prompt_logprobs), lv.spec)

    def drain(self, max_steps: int = 20000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        else:
            self.fail(f"not drained after {max_steps} steps: {sorted(self.live)} unfinished")
        if self.live:
            self.fail(f"requests {sorted(self.live)} never got a final output")
        self.engine.check_resources()
        s = self.engine.stats()
        if s["num_free_blocks"] != s["num_blocks"] or s["num_free_slots"] != s["num_slots"]:
            self.fail(f"pools not full at the end: {s}")


TIE_NOISE = 1e-5


class TieCheck:
    """Tells a decision on a knife's edge from a bug. Batches of other shapes round the
    logits' last bits differently (~1e-6), so where a step's choice hangs on a near-tie —
    greedy's top two logits, the k-th and (k+1)-th under top_k, a token at the min_p or
    top_p cut, the sampled uniform at a CDF boundary — the two engines may pick different
    tokens and go on differently from there (the 100,000-operation soak meets a few). A
    divergence at position j is accepted only when the sampler itself, run on a reference
    engine's logits for the prompt plus the j common tokens with the request's parameters
    (penalties, min_tokens, top_k/top_p/min_p, seed and counter, a banning processor),
    picks each of the two tokens under some perturbation of those logits of at most
    TIE_NOISE."""

    def __init__(self, model_dir: str | Path, cfg: SoakConfig) -> None:
        self.model_dir, self.cfg = model_dir, cfg
        self.engine: Engine | None = None
        self.accepted: list[tuple[int, int]] = []  # (request index, position)

    def explains(self, idx: int, spec: RequestSpec, common: tuple[int, ...], a: int, b: int) -> bool:
        import torch

        from pyengine.sampling.sampler import Sampler

        if self.engine is None:
            self.engine = make_engine(self.model_dir, False, self.cfg, 0)
        engine = self.engine
        rows: list = []

        def capture(ids, row):
            rows.append(row.clone())
            return row

        engine.generate([list(spec.prompt) + list(common)],
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logits_processors=[capture]),
                        use_tqdm=False)
        p = dict(spec.params)
        if spec.processor == "ban":
            ban = spec.ban

            def ban_token(ids, row):
                row[ban] = float("-inf")
                return row

            p["logits_processors"] = [ban_token]
        params = SamplingParams(**p)
        eos = [] if params.ignore_eos else list(engine.model_config.eos_token_ids)
        sampler = Sampler(1, engine.model_config.vocab_size, seed=0)
        sampler.init_slot(0, params, list(spec.prompt), list(common), eos + list(params.stop_token_ids),
                          params.seed if params.seed is not None else 0)
        g = torch.Generator().manual_seed(idx)
        picked = set()
        for trial in range(64):
            row = rows[0].clone()
            if trial:
                row += (torch.rand(row.shape, generator=g) * 2 - 1) * TIE_NOISE
            picked.add(int(sampler.sample(row[None], torch.tensor([0])).tokens[0]))
            if a in picked and b in picked:
                self.accepted.append((idx, len(common)))
                return True
        return False

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def compare(idx: int, finals: dict[str, Final], ties: TieCheck | None = None) -> None:
    """One request's finals from every engine (see the module docstring)."""
    (na, a), *rest = finals.items()
    for nb, b in rest:
        where = f"request {idx} ({a.spec}): {na} vs {nb}"
        n = min(len(a.token_ids), len(b.token_ids))
        diverged = next((k for k in range(n) if a.token_ids[k] != b.token_ids[k]), None)
        if diverged is not None and ties is not None and ties.explains(
                idx, a.spec, a.token_ids[:diverged], a.token_ids[diverged], b.token_ids[diverged]):
            if a.logprobs is not None and not logprobs_close(a.logprobs[:diverged], b.logprobs[:diverged]):
                raise SoakFailure(f"{where}: logprobs before a near-tie divergence differ")
            continue
        if a.finish_reason != "abort" and b.finish_reason != "abort":
            for fld in ("token_ids", "finish_reason", "text", "stop_reason"):
                if getattr(a, fld) != getattr(b, fld):
                    raise SoakFailure(f"{where}: {fld} differ:\n  {getattr(a, fld)!r}\n  {getattr(b, fld)!r}")
            for fld in ("logprobs", "prompt_logprobs"):
                if not logprobs_close(getattr(a, fld), getattr(b, fld)):
                    raise SoakFailure(f"{where}: {fld} differ:\n  {getattr(a, fld)!r}\n  {getattr(b, fld)!r}")
            continue
        if diverged is not None:
            raise SoakFailure(f"{where}: aborted, and no token list is a prefix of the other:\n"
                              f"  {a.token_ids}\n  {b.token_ids}")
        if a.logprobs is not None and not logprobs_close(a.logprobs[:n], b.logprobs[:n]):
            raise SoakFailure(f"{where}: aborted, logprobs of the common tokens differ")


# ---- the soak --------------------------------------------------------------------------------


@dataclass
class SoakResult:
    ops: int
    runs: dict[str, SoakRun]
    compared: int
    near_ties: list[tuple[int, int]]  # divergences explained by a near-tie (TieCheck): (request, position)


def run_soak(model_dir: str | Path, seed: int, num_ops: int, modes: dict[str, bool],
             cfg: SoakConfig = SoakConfig(), on_progress: Callable[[int, dict[str, SoakRun]], None] | None = None,
             progress_every: int = 1000) -> SoakResult:
    """Runs `num_ops` operations in lockstep on one engine per mode (name -> overlap), then
    drains them. The first mode's engine drives the random choices. Raises SoakFailure
    (with the last operations) on any violation. on_progress(ops done, runs) is called
    every `progress_every` operations, and once more after the drain with ops done = -1
    (the engines are still up then)."""
    # The injected Ctrl-Cs need Python's SIGINT handler: a shell's background job starts with
    # SIGINT ignored (then a Ctrl-C does nothing, in the engine as anywhere).
    previous_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    runs = {name: SoakRun(name, make_engine(model_dir, overlap, cfg, seed), cfg) for name, overlap in modes.items()}
    driver = next(iter(runs.values()))
    gen = OpGenerator(seed, cfg, driver.engine.model_config.vocab_size)
    history: deque[tuple[int, Op]] = deque(maxlen=40)
    compared = 0
    ties = TieCheck(model_dir, cfg)

    def settle() -> int:
        n = 0
        ready = set.intersection(*(set(r.new_finals) for r in runs.values()))
        for idx in sorted(ready):
            compare(idx, {name: r.new_finals.pop(idx) for name, r in runs.items()}, ties)
            n += 1
        return n

    try:
        for i in range(num_ops):
            op = gen.next(driver.view())
            history.append((i, op))
            for r in runs.values():
                try:
                    r.apply(op)
                except SoakFailure:
                    raise
                except Exception as e:  # the engine raised: name it, keep where
                    where = "".join(traceback.format_exception(e)[-12:])
                    raise SoakFailure(f"[{r.name}] {type(e).__name__}: {e}\n{where}") from e
            compared += settle()
            if on_progress is not None and (i + 1) % progress_every == 0:
                on_progress(i + 1, runs)
        for r in runs.values():
            r.drain()
        compared += settle()
        if on_progress is not None:
            on_progress(-1, runs)
        left = {name: sorted(r.new_finals) for name, r in runs.items() if r.new_finals}
        if left:
            raise SoakFailure(f"finals not matched across engines: {left}")
    except BaseException as e:
        ops = "\n".join(f"  {i}: {op}" for i, op in history)
        raise SoakFailure(f"soak seed={seed} failed: {type(e).__name__}: {e}\nlast operations:\n{ops}") from e
    finally:
        for r in runs.values():
            r.engine.shutdown()
        ties.close()
        signal.signal(signal.SIGINT, previous_sigint)
    return SoakResult(num_ops, runs, compared, ties.accepted)
