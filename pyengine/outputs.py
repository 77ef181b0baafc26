"""What step() and generate() return."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of a request's life; -1 when not reached."""

    arrival_time: float
    first_scheduled_time: float = -1.0
    first_token_time: float = -1.0
    finish_time: float = -1.0
    num_pauses: int = 0          # times it was paused and recomputed
    num_reused_tokens: int = 0   # prompt tokens whose KV came from the prefix cache

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

    request_id: int
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
