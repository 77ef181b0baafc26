"""What step() returns (RequestOutput, RequestMetrics) and how it is built: the Python side of
a request (RequestRecord: its text, stop strings, logprobs) and the stop-string search."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyengine.engine.detokenizer import IncrementalDetokenizer
from pyengine.sampling.params import SamplingParams


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of a request's life; -1 when not reached."""

    arrival_time: float
    first_scheduled_time: float = -1.0
    first_token_time: float = -1.0
    finish_time: float = -1.0
    num_pauses: int = 0          # times it was paused and recomputed
    num_reused_tokens: int = 0   # prompt tokens whose KV came from the prefix cache
    num_draft_tokens: int = 0    # speculative decoding: draft tokens verified
    num_accepted_draft_tokens: int = 0  # ... and accepted

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens (None: no drafts)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time < 0 else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_tokens: int) -> float | None:
        """Mean seconds between tokens after the first, for a finished request of num_tokens."""
        if self.finish_time < 0 or self.first_token_time < 0 or num_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (num_tokens - 1)


@dataclass
class RequestOutput:
    """A request's state after a step.

    token_ids: every token generated so far; new_token_ids: those of this step.
    text: the detokenized output so far (cut at a stop string); new_text: this step's part.
    finish_reason: None while running, then "stop" (end id, stop token or stop string),
        "length" (max_tokens reached) or "abort".
    stop_reason: the stop token id or stop string that ended the request.
    logprobs: per generated token, {token id: logprob} of the top-N and the chosen token
        (SamplingParams.logprobs); prompt_logprobs likewise per prompt token (None first).
    """

    request_id: int | str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)


def find_stop_string(text: str, start: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that ends at or after `start` in text: (index, string)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins some stop string (held back from
    streaming until it is known whether the stop string completes)."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


@dataclass
class RequestRecord:
    """The engine's Python-side record of a live request: what it asked for and what it has
    been shown (text, logprobs). Its scheduling state lives in the C++ batch manager, under
    `core_id`; `request_id` is the caller's id (int or str)."""

    request_id: int | str
    core_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stop_ids: list[int]            # masked while min_tokens is not reached
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    text: str = ""                 # what the user has been shown (cut at a stop string)
    stop_reason: int | str | None = None
    matcher: Any = None            # guided decoding: the grammar matcher (xgrammar) of its tokens

    def __post_init__(self) -> None:
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def append_token(self, token: int, logprobs: dict[int, float] | None, final: bool) -> tuple[str, bool]:
        """Adds a generated token; returns (new visible text, whether a stop string ended it)."""
        self.token_ids.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        before = len(self.text)
        self.detokenizer.add([token], final=final)
        full = self.detokenizer.text
        stops = self.params.stop
        if stops:
            if len(self.token_ids) >= self.params.min_tokens:
                # in what has not been shown (what has stays: a stop string's beginning is
                # held back, but under min_tokens a whole one may sit before another's)
                hit = find_stop_string(full[before:], 0, stops)
                if hit is not None:
                    index, s = hit[0] + before, hit[1]
                    self.text = full[: index + len(s)] if self.params.include_stop_str_in_output else full[:index]
                    self.stop_reason = s
                    return self.text[before:], True
            # hold back what may be the start of a stop string (under min_tokens too: one
            # completed at min_tokens must not begin in text already shown)
            if not final:
                full = full[: len(full) - partial_stop_suffix(full, stops)]
        self.text = full if len(full) > before or final else self.text
        return self.text[before:], False

    def output(self, new_token_ids: list[int], new_text: str, finished: bool,
               finish_reason: str | None) -> RequestOutput:
        return RequestOutput(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                             token_ids=list(self.token_ids), new_token_ids=new_token_ids, text=self.text,
                             new_text=new_text, finished=finished, finish_reason=finish_reason,
                             stop_reason=self.stop_reason if finished else None,
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             prompt_logprobs=self.prompt_logprobs, metrics=self.metrics)


def metrics_from_core(m: dict[str, Any]) -> RequestMetrics:
    return RequestMetrics(arrival_time=m["arrival_time"], first_scheduled_time=m["first_scheduled_time"],
                          first_token_time=m["first_token_time"], finish_time=m["finish_time"],
                          num_pauses=m["num_pauses"], num_reused_tokens=m["num_reused_tokens"],
                          num_draft_tokens=m["num_draft_tokens"], num_accepted_draft_tokens=m["num_accepted_draft_tokens"])
