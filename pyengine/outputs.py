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
    num_pauses: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time < 0 else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after a step.

    token_ids: every token generated so far; new_token_ids: those of this step.
    finish_reason: None while running, then "stop" (end id or stop token), "length"
        (max_tokens reached) or "abort".
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)
