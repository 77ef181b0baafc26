"""The step loop: one step() is schedule -> forward -> sample -> update -> respond -> free, in
that order, plain or overlapped; and the rollback that makes a failed step change nothing.

Plain: every action of step n happens in the call that runs it.

Overlap: the call that runs step n's forward (in a worker thread) first commits step n-1, which
the previous call sampled (`_update`, cheap: the C++ update and the sampler's counters), and
builds step n-1's outputs (detokenization, stop strings) while the forward runs; every output
arrives one call later, identical to the plain loop's. Where the loop waits for the worker:
`future.result()` in `_step_overlap`.

Atomic: if the schedule (BatchManager::schedule undoes its own failures), the sampler rows,
the forward, the sampler or a user's logits processor raises, `_undo_schedule` rolls the batch
manager back (`BatchManager::rollback`) and releases the sampler rows -- with overlap, after the
worker has finished with the metadata buffers -- so the engine is as it was before the step,
except that the requests the step paused stay paused (the failed forward may have written into
the blocks their pause freed) and are recomputed later, outputs unchanged; outputs already
built or owed (the previous step's, with overlap, and the aborts the schedule dropped) come
with the next step that succeeds.

Ctrl-C: a step holds SIGINT back (`InterruptGate`) and lets it through only while the forward
and the sampler run -- there a KeyboardInterrupt is a failure like any other and is undone --
so it never lands half-way through the bookkeeping. One that arrives during the bookkeeping is
raised when the step has completed; that step's outputs come with the next step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from pyengine.core import CoreBatchManager, FinishReason
from pyengine.engine.interrupts import InterruptGate
from pyengine.engine.outputs import RequestOutput, RequestRecord, metrics_from_core
from pyengine.engine.requests import RequestTable
from pyengine.engine.step_cost import OnlineStepCost
from pyengine.runtime.draft_runner import DraftModelRunner, Proposal
from pyengine.runtime.model_runner import Forwarded, ModelRunner
from pyengine.sampling import DraftRows, SampleResult, Sampler, drafts_allowed
from pyengine.sampling.logprobs import PromptRows, prompt_logprob_rows, record_prompt_logprobs

logger = logging.getLogger("pyengine")

# The C++ FinishReason values -> the finish_reason users see.
FINISH_REASONS: dict[int, str] = {int(FinishReason.kEndId): "stop", int(FinishReason.kStopToken): "stop",
                                  int(FinishReason.kLength): "length", int(FinishReason.kAbort): "abort",
                                  int(FinishReason.kStopString): "stop"}

# An updated step's output for one request: (core id, its tokens of this step -- one, or more
# when it accepted draft tokens --, C++ finish reason, logprobs per token, metrics dict of a
# request that finished, else None).
UpdateItem = tuple[int, list[int], int, "list[dict[int, float] | None]", "dict | None"]


@dataclass
class Batch:
    """One scheduled step: sizes from the batch manager, its events, prompt-logprob rows."""

    num_tokens: int
    num_seqs: int
    num_logits: int
    events: dict
    prompt_rows: PromptRows | None = None
    shape: tuple[int, int, int] = (0, 0, 0)  # (sequences, tokens, attention pairs): the cost model's
    num_drafts: int = 0  # draft tokens among the generation rows (speculative decoding)
    num_generation_seqs: int = 0
    proposal: Proposal | None = None  # the draft model's drafts (set by the forward)


class StepLoop:
    """Runs steps over the batch manager, the model runner and the sampler; owns what is in
    flight between two calls (overlap) and the outputs owed to the next call."""

    def __init__(self, bm: CoreBatchManager, runner: ModelRunner, sampler: Sampler, table: RequestTable,
                 overlap: bool, step_cost: OnlineStepCost | None = None,
                 drafter: DraftModelRunner | None = None) -> None:
        self.bm, self.runner, self.sampler, self.table = bm, runner, sampler, table
        self.drafter = drafter  # speculative decoding's draft model (None: drafts from prompt lookup, or none)
        # corrected from every step's measured time and handed to the batch manager (None: the
        # batch manager's model is fixed)
        self.step_cost = step_cost
        self._budget_ms: float | None = None  # this call's time budget (schedule reads it)
        self._step_batch: Batch | None = None  # the batch this call forwarded (its time is measured)
        # overlap: one worker thread runs the forward while the caller's thread builds outputs
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyengine-forward") if overlap else None
        self._inflight: tuple[Batch, Forwarded, SampleResult] | None = None  # sampled, not yet updated
        self._unresponded: list[UpdateItem] | None = None  # updated (overlap), outputs not yet built
        self._output_error: Exception | None = None  # an output that failed to build this step
        self._pending_outputs: list[RequestOutput] = []  # owed by a step that failed
        self.reset_timings()

    @property
    def overlap(self) -> bool:
        return self._pool is not None

    def has_work(self) -> bool:
        """Outputs are still owed: a step in flight, or outputs held back by a failed step."""
        return self._inflight is not None or self._unresponded is not None or bool(self._pending_outputs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._inflight = None

    # ---- the two loops --------------------------------------------------------------------------

    def step(self, budget_ms: float | None = None) -> list[RequestOutput]:
        # on a GPU, everything a step does on the device (sampler state, sampling, token copies)
        # goes on the execution stream, ordered after the forward
        start = time.perf_counter()
        self._budget_ms, self._step_batch = budget_ms, None
        gate = InterruptGate()  # Ctrl-C lands only in the forward/sampler windows, or after the step
        try:
            with self.runner.stream_context(), gate:
                outputs = self._step_overlap(gate) if self._pool is not None else self._step_plain(gate)
        except BaseException:
            gate.deliver()  # a Ctrl-C held back during a step that then failed is not lost
            raise
        if self.step_cost is not None and self._step_batch is not None:
            batch = self._step_batch
            # the budget priced what the step computed beyond one token per generation row
            bound = budget_ms is not None and batch.shape[1] > batch.num_generation_seqs
            self._learn_step_cost(batch.shape, (time.perf_counter() - start) * 1e3, bound)
        error, self._output_error = self._output_error, None
        if gate.held or error is not None:  # the step is complete: the next step delivers its outputs
            self._pending_outputs = outputs + self._pending_outputs
            gate.deliver()  # a Ctrl-C during the step's bookkeeping
            if error is not None:
                raise error
            outputs, self._pending_outputs = self._pending_outputs, []  # the handler did not raise
        return outputs

    def _step_plain(self, gate: InterruptGate) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch = self._schedule()
        t1 = time.perf_counter()
        try:
            with gate.window():
                forwarded = self._forward(batch) if batch.num_seqs else None
                t2 = time.perf_counter()
                result = self._sample(batch, forwarded) if batch.num_seqs else None
        except BaseException:
            self._undo_schedule(batch.events)
            self._pending_outputs.extend(self._abort_outputs(batch.events))
            raise
        t3 = time.perf_counter()
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs += self._abort_outputs(batch.events)
        if result is not None:
            self._step_batch = batch
            outputs += self._respond(self._update(batch, forwarded, result))
            self.bm.free_finished()
            self._account(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return outputs

    def _step_overlap(self, gate: InterruptGate) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._inflight is not None:  # step n-1: sampled last call; its C++ update is cheap
            self._unresponded = self._update(*self._inflight)
            self._inflight = None
        # What ended by a stop condition has left every batch: what the update ended, and what a
        # stop string ended during a step that then failed (nothing updates that one)
        self.bm.free_finished()
        batch = self._schedule()  # if it fails, step n-1's outputs are kept for the next step
        t1 = time.perf_counter()
        future = self._pool.submit(self._forward, batch) if batch.num_seqs else None
        # While the forward runs: step n-1's outputs (detokenization, stop strings).
        outputs, self._pending_outputs = self._pending_outputs, []
        items, self._unresponded = self._unresponded, None
        if items is not None:
            outputs += self._respond(items)
        outputs += self._abort_outputs(batch.events)
        t2 = time.perf_counter()
        try:
            with gate.window():
                forwarded = future.result() if future is not None else None  # the loop waits here
                t3 = time.perf_counter()
                result = self._sample(batch, forwarded) if future is not None else None
        except BaseException:
            if future is not None:  # interrupted while waiting: the worker may still be in the
                wait([future])      # forward, reading the metadata buffers the undo rewrites
            self._undo_schedule(batch.events)
            # `outputs` holds step n-1's and the aborts' outputs: the next step that succeeds delivers them
            self._pending_outputs = outputs + self._pending_outputs
            raise
        if result is not None:
            self._step_batch = batch
            self._inflight = (batch, forwarded, result)
            self._account(t1 - t0, t3 - t2, time.perf_counter() - t3, t2 - t1)
        return outputs

    # ---- schedule and its undo ------------------------------------------------------------------

    def _schedule(self) -> Batch:
        """The batch manager's schedule, the aborts it dropped, the sampler rows of the requests
        it gave a slot. If anything fails, the schedule is undone (BatchManager::schedule undoes
        its own failure), the rows of what it paused or aborted are released, and the outputs
        owed -- an updated step's (overlap), then the aborts' -- wait for the next step."""
        bm = self.bm
        events = None
        if self._budget_ms is not None:
            self._price_with_current_fit()
        try:
            num_tokens, num_seqs, num_logits = bm.schedule(time.monotonic(), self._budget_ms)
            events = bm.events()
            batch = Batch(num_tokens, num_seqs, num_logits, events, num_drafts=bm.num_draft_tokens if num_seqs else 0,
                          num_generation_seqs=bm.num_generation_seqs if num_seqs else 0)
            if self.step_cost is not None and num_seqs:
                batch.shape = bm.scheduled_shape()
            self._assign_sampler_rows(events)
            if num_seqs and self.table.num_owed_prompt_logprobs:
                batch.prompt_rows = self._prompt_logprob_rows(num_seqs)
        except BaseException:
            if events is None:
                bm.rollback()  # (a no-op when schedule() itself failed: it undid itself)
                events = bm.events()
            else:
                self._undo_schedule(events)
            self._release_dropped_rows(events)
            if self._unresponded is not None:
                items, self._unresponded = self._unresponded, None
                self._pending_outputs.extend(self._respond(items))
            self._pending_outputs.extend(self._abort_outputs(events))
            raise
        return batch

    def _undo_schedule(self, events: dict) -> None:
        """A step failed: roll the schedule back (the aborts it dropped stay dropped, the caller
        keeps their final outputs for the next step that succeeds; the requests it paused stay
        paused)."""
        if self.runner.is_cuda:  # the failed step's queued copies and kernels finish first:
            self.runner.stream.synchronize()  # the next schedule rewrites the buffers they read
        self._release_sampler_rows(events)
        self.bm.rollback()

    def _assign_sampler_rows(self, events: dict) -> None:
        """Releases the rows of paused/aborted requests, then sets up those of requests that got a slot (a
        row is rewritten whole when assigned, so no stale state is ever read)."""
        self._release_dropped_rows(events)
        for core_id, slot in zip(events["assigned"], events["assigned_slots"]):
            self._init_sampler_row(self.table.records[core_id], slot)

    def _release_dropped_rows(self, events: dict) -> None:
        """The rows of the requests a schedule paused or aborted (idempotent)."""
        for slot in events["paused_slots"] + events["aborted_slots"]:
            if slot >= 0:
                self.sampler.release_slot(slot)

    def _release_sampler_rows(self, events: dict) -> None:
        """Undoes _assign_sampler_rows for a step that failed: the newly assigned rows go. (The
        requests it paused stay paused, rows released: the batch manager's rollback keeps
        pauses, whose freed blocks the failed forward may have written.)"""
        for slot in events["assigned_slots"]:
            self.sampler.release_slot(slot)

    def _init_sampler_row(self, rec: RequestRecord, slot: int) -> None:
        self.sampler.init_slot(slot, rec.params, rec.prompt_token_ids, rec.token_ids, rec.stop_ids, rec.seed,
                               rec.matcher)

    def _prompt_logprob_rows(self, num_seqs: int) -> PromptRows | None:
        r = self.runner
        records = [self.table.records.get(core_id) for core_id in r.request_ids[:num_seqs].tolist()]
        return prompt_logprob_rows(records, r.query_start_loc[: num_seqs + 1].tolist(), r.seq_lens[:num_seqs].tolist())

    # ---- forward, sample, update ----------------------------------------------------------------

    def _forward(self, batch: Batch) -> Forwarded:
        if self.drafter is not None:  # the drafts go into the batch's input rows first
            batch.proposal = self.drafter.propose(self.runner, batch.num_seqs, batch.num_generation_seqs,
                                                  batch.num_logits, self._speculates, self.sampler)
        extra = None if batch.prompt_rows is None else batch.prompt_rows[0]
        return self.runner.forward(batch.num_tokens, batch.num_seqs, batch.num_logits, extra)

    def _speculates(self, core_id: int) -> bool:
        rec = self.table.records.get(core_id)
        return rec is not None and drafts_allowed(rec.params)

    def _sample(self, batch: Batch, forwarded: Forwarded) -> SampleResult:
        """Samples the batch (padding rows too: their tokens go to the scratch row); changes no
        state (_update commits it). On a GPU the tokens start their way to the host."""
        offsets = drafts = None
        if batch.num_drafts:
            offsets = self.runner.logits_offsets[: forwarded.num_rows]
            drafts = self._draft_rows(forwarded.num_rows, None if batch.proposal is None else batch.proposal.probs)
        result = self.sampler.sample(forwarded.logits[: forwarded.num_rows], forwarded.slots, offsets, drafts)
        result.host_tokens, result.ready = self.runner.tokens_to_host(result.tokens)
        return result

    def _draft_rows(self, n: int, probs) -> DraftRows:
        """The step's drafts as the n logits rows see them (whoever proposed them: prompt lookup,
        a caller, the draft model, which wrote its own into the input rows): the draft after row
        i is the input of token row i + 1 where that row is the same sequence's next (generation
        sequences come first, their logits rows one to one with their token rows). `probs`: the
        draft model's distributions (None: point masses)."""
        offsets = self.runner.logits_offsets[:n].to(torch.int64)
        ids = self.runner.input_ids[:n].to(torch.int64)
        following = torch.full((n,), -1, dtype=torch.int64)
        if n > 1:
            following[:-1] = torch.where(offsets[1:] == offsets[:-1] + 1, ids[1:], -1)
        return DraftRows(following.to(self.sampler.device), probs)

    def _update(self, batch: Batch, forwarded: Forwarded, result: SampleResult) -> list[UpdateItem]:
        """Commits a sampled step: sampler counters, the token buffer, the batch manager's update
        (stop conditions). Requests it ended have their sampler rows released and metrics read
        here, before free_finished() returns their slots."""
        bm, sampler = self.bm, self.sampler
        if result.ready is not None:
            result.ready.synchronize()  # the step's tokens have reached the host
        if not batch.num_drafts:
            sampler.commit(result)
            self.runner.record_tokens(forwarded, result.tokens)
        elif batch.proposal is not None:  # the draft model's drafts replace the schedule's placeholders
            bm.set_scheduled_draft_tokens(batch.proposal.tokens)
        bm.update_from_ptr(result.host_tokens.data_ptr(), batch.num_logits, time.monotonic())
        outputs = bm.step_outputs()
        if self.drafter is not None:
            emitted: dict[int, int] = {}
            for core_id, *_ in outputs:
                emitted[core_id] = emitted.get(core_id, 0) + 1
            self.drafter.commit(batch.proposal, emitted, self.table.__contains__)
        if batch.num_drafts:  # only the tokens the requests kept count: accepted drafts and the one after
            sampler.commit(result, [row for *_, row in outputs])
            last_rows = {core_id: row for core_id, *_, row in outputs}
            self.runner.record_tokens(forwarded, result.tokens, list(last_rows.values()))
        if batch.prompt_rows is not None:
            done = record_prompt_logprobs(forwarded.logits[forwarded.num_rows:], batch.prompt_rows[1])
            self.table.num_owed_prompt_logprobs -= done
        items: list[UpdateItem] = []
        # each output names the logits row its token came from: a row whose request the caller
        # ended after scheduling it (a stop string, with overlap) has no output; a request's
        # outputs are consecutive (several when it accepted draft tokens, the last one finishing it)
        for core_id, token, done, reason, row in outputs:
            if items and items[-1][0] == core_id:
                items[-1][1].append(token)
                items[-1][3].append(result.logprobs[row])
            else:
                items.append((core_id, [token], reason, [result.logprobs[row]], None))
            if done:
                metrics = bm.request_metrics(core_id)
                sampler.release_slot(metrics["seq_slot"])
                items[-1] = (core_id, items[-1][1], reason, items[-1][3], metrics)
        return items

    # ---- respond --------------------------------------------------------------------------------

    def _respond(self, items: list[UpdateItem]) -> list[RequestOutput]:
        """Outputs of an updated step: text, stop strings (which end a request early), logprobs,
        metrics. The step is committed: a request whose output fails to build (its detokenizer
        raised, say) ends with finish_reason "abort", the others' outputs are built, and the
        error reaches the caller once the step is complete (`_output_error`)."""
        outputs = []
        for item in items:
            try:
                out = self._respond_one(*item)
            except Exception as e:  # noqa: BLE001 - kept and raised by step() once the step is complete
                out = self._end_failed_output(item[0], e)
            if out is not None:
                outputs.append(out)
        return outputs

    def _end_failed_output(self, core_id: int, error: Exception) -> RequestOutput | None:
        logger.error("building the output of request %s failed; it ends with finish_reason 'abort'",
                     self.table.records[core_id].request_id if core_id in self.table else core_id, exc_info=error)
        if self._output_error is None:
            self._output_error = error
        rec = self.table.records.get(core_id)
        if rec is None:
            return None
        if self.bm.abort_request(core_id):  # still running: the next schedule drops it (its final output then)
            slot = self.bm.request_metrics(core_id)["seq_slot"]
            if slot >= 0:
                self.sampler.release_slot(slot)
            return None
        self.table.remove(core_id)  # finished in the C++ core: its final output is owed now
        rec.metrics.finish_time = time.monotonic()
        return rec.output([], "", True, "abort")

    def _respond_one(self, core_id: int, tokens: list[int], reason: int, logprobs: list[dict[int, float] | None],
                     metrics: dict | None) -> RequestOutput | None:
        rec = self.table.records[core_id]
        done = metrics is not None
        new_text, stopped, kept = "", False, []
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            # guided decoding: a grammar that accepted this token as its end ends the request
            # (when the core has not: ignore_eos, or a grammar that ends without an
            # end-of-sequence token); tokens after it (accepted drafts) are dropped
            end_at = None if rec.matcher is None else rec.matcher.terminated_at
            grammar_end = end_at is not None and end_at <= len(rec.token_ids) + 1
            piece, stopped = rec.append_token(token, logprobs[i], final=(done and last) or grammar_end)
            new_text += piece
            kept.append(token)
            if grammar_end and not stopped and not (done and last):
                stopped = True
                rec.stop_reason = token if token in rec.matcher.stop_token_ids else None
            if stopped:  # a stop string inside accepted drafts cuts there: later tokens are dropped
                break
        if stopped and not done:
            now = time.monotonic()
            if self.bm.finish_stopped(core_id, now):
                metrics = self.bm.request_metrics(core_id)
                if metrics["seq_slot"] >= 0:  # none if this call's schedule paused it (overlap)
                    self.sampler.release_slot(metrics["seq_slot"])
            else:
                # Overlap: the caller aborted the request after this token was sampled, and
                # this step's schedule has already dropped it (slot and blocks are back).
                # The stop string came first, as it would have without overlap: the request
                # ends by it, and no abort output follows (_abort_outputs skips it).
                rec.metrics.finish_time = now
                self.table.remove(core_id)
                return rec.output(kept, new_text, True, "stop")
        if metrics is None:
            return rec.output(kept, new_text, False, None)
        rec.metrics = metrics_from_core(metrics)
        if not stopped and metrics["stop_token"] >= 0:
            rec.stop_reason = metrics["stop_token"]
        self.table.remove(core_id)
        return rec.output(kept, new_text, True, "stop" if stopped else FINISH_REASONS[reason])

    def _abort_outputs(self, events: dict) -> list[RequestOutput]:
        """Final outputs of the requests the schedule dropped (after any output of theirs from
        the step before, with overlap; none for one that step's stop string already ended)."""
        outputs = []
        for core_id in events["aborted"]:
            if core_id not in self.table:
                continue
            rec = self.table.remove(core_id)
            rec.metrics.finish_time = time.monotonic()
            outputs.append(rec.output([], "", True, "abort"))
        return outputs

    # ---- timings --------------------------------------------------------------------------------

    def _learn_step_cost(self, shape: tuple[int, int, int], ms: float, budget_bound: bool) -> None:
        """One measured step corrects the cost model (the fit is solved when a budgeted step
        needs it: _price_with_current_fit)."""
        self.step_cost.observe(*shape, ms, budget_bound)

    def _price_with_current_fit(self) -> None:
        """Before a budgeted schedule: the batch manager takes the fit of the steps so far."""
        if self.step_cost is not None and self.step_cost.changed:
            m = self.step_cost.scheduled
            self.bm.set_step_cost_model(m.fixed_ms, m.per_seq_ms, m.per_token_ms, m.per_kpair_ms)

    def _account(self, schedule: float, forward: float, sample: float, update: float) -> None:
        t = self._timings
        t["schedule"] += schedule
        t["forward"] += forward
        t["sample"] += sample
        t["update"] += update
        t["steps"] += 1

    def timings(self) -> dict[str, float]:
        return dict(self._timings)

    def reset_timings(self) -> None:
        self._timings = dict.fromkeys(("schedule", "forward", "sample", "update", "steps"), 0.0)
