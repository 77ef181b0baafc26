"""Overlap-loop races, each pinned by a small deterministic case (the first two from the
issue's soak; the others found by tests/test_soak.py).

1. A stop string found in step n-1's token ends a request that step n has already
   scheduled; step n's update discards that request's token. Its logits row still exists,
   so the requests after it in the batch must take their logprobs from their own rows, not
   by position among the step's outputs.
2. The user aborts a request between two overlapped calls, and step n-1's token (delivered
   by the next call, after step n's schedule has dropped the request) completes a stop
   string. The earlier event wins, as without overlap: the final output is the stop-string
   one, no abort output follows, nothing leaks. (Likewise when step n-1 ends it by length.)
3. A stop string ends a request while the step holding it fails: nothing updates that
   step, so the request must be retired before the next schedule, not scheduled again.
4. Step n's schedule pauses a request (max_utilization) whose step n-1 token completes a
   stop string: it must end with that stop output and leave the queue.
"""

from __future__ import annotations

import pytest

from logprob_compare import assert_logprobs_close
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

PROMPT_A = [5, 9, 44, 71, 100, 3, 8]
PROMPT_B = [300, 12, 17, 300, 12, 17, 300, 12, 17]


def make_engine(model_dir, overlap: bool) -> Engine:
    return Engine(model_dir, max_seq_len=128, seed=0, overlap=overlap,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=1024),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=32))


def stop_string_in(engine: Engine, prompt: list[int], after_chars: int) -> str:
    """A two-character string that first occurs at or after `after_chars` in the prompt's
    greedy text (so a request stopping on it runs a few steps first)."""
    text = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0].text
    return next(text[i:i + 2] for i in range(after_chars, len(text) - 2)
                if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) == i)


class Injected(RuntimeError):
    pass


def fail_next_forward(engine: Engine) -> None:
    original = engine._runner.forward

    def failing(*args, **kwargs):
        engine._runner.forward = original
        raise Injected("forward failed")

    engine._runner.forward = failing


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]],
        abort: tuple[int, int] | None = None, fail_at: int | None = None) -> tuple[dict, list]:
    """Steps until everything is done; abort=(request index, call index) aborts that
    request just before that call; fail_at: that call's forward fails (and the call is
    made again). Returns the outputs by index and the calls' outputs."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    by_index: dict[int, list] = {i: [] for i in range(len(ids))}
    calls, call = [], 0
    while engine.has_unfinished_requests():
        if abort is not None and abort[1] == call:
            engine.abort_request(ids[abort[0]])
        if call == fail_at:
            fail_at = None
            fail_next_forward(engine)
            with pytest.raises(Injected):
                engine.step()
            engine.check_resources()
        outs = engine.step()
        engine.check_resources()
        calls.append([(ids.index(o.request_id), o.finish_reason) for o in outs])
        for o in outs:
            by_index[ids.index(o.request_id)].append(o)
        call += 1
    engine.check_resources()
    return by_index, calls


def test_logprobs_stay_with_their_rows_when_a_stop_string_discards_a_token(llama_dir):
    """A (no logprobs) stops on a string while B (logprobs) keeps decoding behind it in
    the batch: B must keep one logprob entry per token, the same as without overlap."""
    stop = stop_string_in(make_engine(llama_dir, False), PROMPT_A, after_chars=8)
    requests = [(PROMPT_A, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])),
                (PROMPT_B, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2))]
    plain, _ = run(make_engine(llama_dir, False), requests)
    over, _ = run(make_engine(llama_dir, True), requests)
    assert plain[0][-1].finish_reason == "stop" and len(plain[0][-1].token_ids) < 30
    b_plain, b_over = plain[1][-1], over[1][-1]
    assert b_over.finish_reason == b_plain.finish_reason == "length"
    assert b_over.token_ids == b_plain.token_ids
    assert len(b_over.logprobs) == len(b_over.token_ids)
    assert_logprobs_close(b_over.logprobs, b_plain.logprobs)


def test_an_abort_racing_a_stop_string_gives_the_stop_output_alone(llama_dir):
    """Without overlap A's stop-string output arrives at call p and an abort after it is
    refused. With overlap step p is still in flight after call p: abort it then, and call
    p+1 must deliver the same stop-string output as A's only final output."""
    stop = stop_string_in(make_engine(llama_dir, False), PROMPT_A, after_chars=8)
    requests = [(PROMPT_A, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])),
                (PROMPT_B, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1))]
    plain, plain_calls = run(make_engine(llama_dir, False), requests)
    p = next(c for c, outs in enumerate(plain_calls) if (0, "stop") in outs)
    over, over_calls = run(make_engine(llama_dir, True), requests, abort=(0, p + 1))
    finals = [o for o in over[0] if o.finished]
    assert [o.finish_reason for o in finals] == ["stop"]
    assert over[0][-1].finished  # nothing after it
    a_plain, a_over = plain[0][-1], over[0][-1]
    assert (a_over.token_ids, a_over.text, a_over.stop_reason) == (a_plain.token_ids, a_plain.text, stop)
    assert (0, "stop") in over_calls[p + 1]
    assert over[1][-1].token_ids == plain[1][-1].token_ids


def test_an_abort_racing_the_last_token_gives_one_final_output(llama_dir):
    """Likewise when the in-flight step ends the request by length: one final output,
    finish_reason "length", no abort output after it."""
    requests = [(PROMPT_A, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)),
                (PROMPT_B, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1))]
    plain, plain_calls = run(make_engine(llama_dir, False), requests)
    p = next(c for c, outs in enumerate(plain_calls) if (0, "length") in outs)
    over, over_calls = run(make_engine(llama_dir, True), requests, abort=(0, p + 1))
    assert [o.finish_reason for o in over[0] if o.finished] == ["length"]
    assert over[0][-1].token_ids == plain[0][-1].token_ids
    assert (0, "length") in over_calls[p + 1]


def test_a_failed_step_retires_the_request_a_stop_string_ended_in_it(llama_dir):
    """A's stop string is found in step p's token while step p+1's forward runs, and that
    forward fails. A is ended but still holds its seat and blocks (its row was in the failed
    batch): it must be retired before the next schedule, not scheduled again."""
    stop = stop_string_in(make_engine(llama_dir, False), PROMPT_A, after_chars=8)
    requests = [(PROMPT_A, SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])),
                (PROMPT_B, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1))]
    plain, plain_calls = run(make_engine(llama_dir, False), requests)
    p = next(c for c, outs in enumerate(plain_calls) if (0, "stop") in outs)
    over, _ = run(make_engine(llama_dir, True), requests, fail_at=p + 1)
    for i in range(2):
        assert [o.finish_reason for o in over[i] if o.finished] == [plain[i][-1].finish_reason]
        assert over[i][-1].token_ids == plain[i][-1].token_ids
        assert over[i][-1].text == plain[i][-1].text


def test_a_stop_string_ends_a_request_that_the_next_schedule_paused(llama_dir):
    """Under max_utilization, step n's schedule pauses X (blocks ran out) just as step
    n-1's token, whose text arrives after that schedule with overlap, completes X's stop
    string. Without overlap X stops first and is never paused; with overlap it must still
    end with that stop output and leave the queue (not be recomputed, no leak)."""
    def engine(overlap: bool) -> Engine:
        return Engine(llama_dir, max_seq_len=40, seed=0, overlap=overlap,
                      kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=48, free_memory_fraction=None),
                      scheduler_config=SchedulerConfig(max_batch_size=2, max_num_tokens=32,
                                                       capacity_scheduler_policy="max_utilization"))

    prompts = [list(range(100, 120)), list(range(200, 212))]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
    # Where X (the second, started last) is first paused, and its text before that.
    probe = engine(False)
    e, x = (probe.add_request(p, sp) for p, sp in zip(prompts, params))
    texts = [""]
    while probe._bm.request_metrics(x)["num_pauses"] == 0:
        for o in probe.step():
            if o.request_id == x:
                texts.append(o.text)
    # The stop string completes with X's last token before the pause.
    before, after = texts[-2], texts[-1]
    stop = next(after[i:j] for j in range(len(before) + 1, len(after) + 1) for i in range(j - 1, -1, -1)
                if after[i:j] not in before and "\ufffd" not in after[i:j])
    requests = [(prompts[0], params[0]),
                (prompts[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]))]
    plain, _ = run(engine(False), requests)
    over, _ = run(engine(True), requests)
    assert plain[1][-1].finish_reason == "stop" and plain[1][-1].metrics.num_pauses == 0
    assert over[1][-1].metrics.num_pauses == 1  # the race happened: paused, then stopped
    for i in range(2):
        assert [o.finish_reason for o in over[i] if o.finished] == [plain[i][-1].finish_reason]
        assert (over[i][-1].token_ids, over[i][-1].text) == (plain[i][-1].token_ids, plain[i][-1].text)
