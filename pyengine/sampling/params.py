"""Per-request decoding parameters (vLLM's single-sequence SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from pyengine.sampling.guided import GuidedDecodingParams

# A logits processor: (token ids generated so far, logits row [vocab]) -> logits row.
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]

MAX_LOGPROBS = 20


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How a request decodes.

    max_tokens: tokens to generate at most (>= 1).
    min_tokens: the end-of-sequence token and `stop_token_ids` cannot be sampled before this
        many tokens (their logits are masked), and stop strings are not checked.
    temperature: 0 decodes greedily (argmax, after penalties); > 0 samples.
    top_k: keep the k most likely tokens; -1 disables. 0 is rejected as ambiguous (some
        libraries read it as "disabled", others as "nothing"): write -1.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p, in (0, 1].
    min_p: drop tokens less likely than min_p x the most likely one's probability, in [0, 1].
    repetition_penalty: > 0; divides positive (multiplies negative) logits of every token in
        the prompt or the output (transformers' definition); 1 disables.
    presence_penalty, frequency_penalty: in [-2, 2]; subtract `presence` once and
        `frequency x count` for each token already generated (OpenAI's definition).
    seed: makes the request's samples reproducible, whatever it is batched with.
    stop_token_ids: token ids that end the request (the token is kept in token_ids).
    stop: strings that end the request when they appear in the text (found across token
        boundaries); the text is cut before the string unless include_stop_str_in_output.
    ignore_eos: keep generating past the model's end-of-sequence token.
    logprobs: return, for each generated token, the log-probabilities of the top-N tokens
        plus the chosen one, under the model's raw distribution (before any transform).
    prompt_logprobs: likewise for each prompt token (the first has none).
    skip_special_tokens: leave special tokens out of `text`.
    logits_processors: functions (generated token ids, logits row) -> logits row, applied
        in order to the raw logits before the transforms above. An exception in one makes
        step() raise with the engine left as it was before that step.
    guided_decoding: constrain the output to a JSON schema, a regex, a grammar, a choice...
        (GuidedDecodingParams); tokens the constraint does not allow are masked after the
        logits processors and before the penalties and temperature, and a request whose
        constraint is complete ends with finish_reason "stop" (by the end-of-sequence token,
        the only one then allowed).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def __setattr__(self, name: str, value: Any) -> None:
        # an assignment after construction sets the field as the constructor's keyword would
        if name in _FIELD_NAMES and "_explicit" in self.__dict__:
            self.__dict__["_explicit"] = self.__dict__["_explicit"] | {name}
        object.__setattr__(self, name, value)

    def is_set(self, name: str) -> bool:
        """True if the caller gave field `name` a value (even the default's)."""
        if name not in _FIELD_NAMES:
            raise ValueError(f"SamplingParams has no field {name!r}")
        return name in self.__dict__.get("_explicit", frozenset(_FIELD_NAMES))

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A copy whose unset fields take `defaults[field]` where given (fields set by the
        caller keep their values); validated. The copy records the same fields as set."""
        unknown = sorted(set(defaults) - _FIELD_NAMES)
        if unknown:
            raise ValueError(f"SamplingParams has no field {unknown[0]!r}")
        values = {f: getattr(self, f) for f in _FIELD_NAMES}
        values.update({k: v for k, v in defaults.items() if not self.is_set(k)})
        out = SamplingParams(**values)
        out.__dict__["_explicit"] = self.__dict__.get("_explicit", frozenset(_FIELD_NAMES))
        return out

    def validate(self) -> None:
        """Raises ValueError/TypeError naming the first bad field and its value."""
        if not _is_int(self.max_tokens):
            raise TypeError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or a positive int, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.logits_processors, (list, tuple)) or any(
                not callable(f) for f in self.logits_processors):
            raise TypeError(f"logits_processors must be a list of callables, got {self.logits_processors!r}")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, GuidedDecodingParams):
            raise TypeError(f"guided_decoding must be GuidedDecodingParams or None, got {self.guided_decoding!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")


_FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))
_POSITIONAL = [f.name for f in fields(SamplingParams)]
_generated_init = SamplingParams.__init__


def _init_recording_explicit(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    # SamplingParams(**other.__dict__) passes the record along: a copy made from every field of
    # another counts every field as set (as dataclasses.replace does)
    kwargs.pop("_explicit", None)
    self.__dict__["_explicit"] = frozenset()  # (the generated __init__'s assignments are not the caller's)
    _generated_init(self, *args, **kwargs)
    self.__dict__["_explicit"] = frozenset(_POSITIONAL[:len(args)]) | frozenset(kwargs)


_init_recording_explicit.__doc__ = _generated_init.__doc__
_init_recording_explicit.__signature__ = __import__("inspect").signature(_generated_init)  # type: ignore[attr-defined]
SamplingParams.__init__ = _init_recording_explicit  # type: ignore[method-assign]
