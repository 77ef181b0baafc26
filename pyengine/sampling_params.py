"""Per-request decoding parameters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How a request decodes.

    max_tokens: tokens to generate at most (>= 1).
    temperature: 0 decodes greedily (argmax). Sampling with temperature > 0 is not
        supported yet and is rejected.
    stop_token_ids: extra token ids that end the request (the token is kept in the output).
    ignore_eos: keep generating past the model's end-of-sequence token.
    skip_special_tokens: leave special tokens out of `text`.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ValueError/TypeError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise TypeError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature != 0:
            raise ValueError(f"temperature {self.temperature} is not supported yet: only greedy decoding "
                             "(temperature=0) is implemented")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
