"""Structured output (guided decoding) with xgrammar: what a request asks for
(`GuidedDecodingParams`, TensorRT-LLM's names), the engine's grammar compiler (built once from the
tokenizer, compiled grammars cached by their text), and one matcher per constrained request.

The sampler keeps a slot-indexed token bitmask (pyengine/sampling/sampler.py): the matchers of
a step's constrained rows fill their rows, the mask is applied to the logits before penalties
and temperature, and the sampled token is accepted by the matcher when the step commits.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, fields
from typing import Any, Sequence

logger = logging.getLogger(__name__)

# the compiled grammars the compiler keeps (least recently used dropped first)
GRAMMAR_CACHE_BYTES = 256 << 20


@dataclass
class GuidedDecodingParams:
    """A constraint on a request's output; exactly one field is set.

    json: a JSON schema (a dict, or its JSON text): the output is a JSON value matching it,
        written compactly (no whitespace but one space after ':' and ',').
    json_object: True: the output is any JSON object (written likewise).
    regex: the output fully matches this regular expression.
    grammar: an EBNF grammar as xgrammar reads it (GBNF-like, rule `root` first).
    choice: the output is exactly one of these strings.
    structural_tag: an xgrammar structural tag (a dict or its JSON text): free text with
        constrained segments between begin/end tags (e.g. tool calls).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None
    structural_tag: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        chosen = self.kinds()
        if len(chosen) != 1:
            raise ValueError(f"GuidedDecodingParams takes exactly one constraint, got {len(chosen)}"
                             f"{': ' + ', '.join(chosen) if chosen else ''}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise TypeError(f"json must be a JSON schema (a dict or a str), got {type(self.json).__name__}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise TypeError(f"{name} must be a non-empty str, got {v!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence) or not self.choice or any(
                    not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise TypeError(f"structural_tag must be a dict or a JSON str, got {type(self.structural_tag).__name__}")

    def kinds(self) -> list[str]:
        """The constraint fields set."""
        return [f.name for f in fields(self)
                if (getattr(self, f.name) is True if f.name == "json_object" else getattr(self, f.name) is not None)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def key(self) -> tuple[str, str]:
        """(kind, text): what the compiled grammar is cached under."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text


def _reason(e: Exception) -> str:
    """An xgrammar error's message without its time stamp, source location and check text."""
    msg = str(e).strip()
    msg = re.sub(r"^\[[\d:.]+\] \S+:\d+: ", "", msg)
    msg = re.sub(r"^Check failed: \(.*?\) is false: ", "", msg)
    return msg


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarBackend:
    """The engine's grammar compiler over its tokenizer and the model's vocabulary size."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=True,
                                            cache_limit_bytes=cache_bytes)
        self.num_compiled = 0  # compile calls (cache hits included)
        self._no_control: Any = None

    def compile(self, params: GuidedDecodingParams) -> Any:
        """The CompiledGrammar of a constraint (from the compiler's cache when the same text was
        compiled before); ValueError naming the constraint when it is not valid."""
        kind, text = params.key()
        c = self.compiler
        try:
            if kind == "json":
                compiled = c.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":  # (compact, like json: a JSON object in any layout never ends)
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                re.compile(text)  # xgrammar's dialect is narrower; Python names most mistakes clearly first
                compiled = c.compile_regex(text)
            elif kind == "grammar":
                compiled = c.compile_grammar(text)
            elif kind == "choice":
                compiled = c.compile_grammar(choice_grammar(params.choice))
            else:
                compiled = c.compile_structural_tag(text)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own kinds for bad input
            shown = text if len(text) <= 200 else text[:200] + "..."
            raise ValueError(f"invalid guided decoding {kind} {shown!r}: {_reason(e)}") from None
        self.num_compiled += 1
        return compiled

    def matcher(self, compiled: Any, stop_token_ids: list[int], kind: str = "") -> "RequestGrammar":
        """A fresh matcher for one request. Its stop tokens are the request's end-of-sequence ids:
        once the grammar is complete only they are allowed (with none, the matcher terminates as
        soon as the grammar is complete)."""
        if stop_token_ids:
            m = self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        else:
            m = self._xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return RequestGrammar(m, self.no_control_chars() if kind in ("json", "json_object") else None)

    def no_control_chars(self) -> Any:
        """A bitmask row allowing the tokens without a raw control character (U+0000-U+001F).
        xgrammar's JSON-schema grammars let strings hold raw control characters, which JSON
        forbids (they must be escaped); compact JSON has no whitespace that needs one, so JSON
        constraints take this mask too, and their output always parses."""
        if self._no_control is None:
            import torch
            allowed = torch.tensor([not any(b < 0x20 for b in tok) for tok in self.tokenizer_info.decoded_vocab],
                                   dtype=torch.bool)
            words = self._xgr.get_bitmask_shape(1, self.vocab_size)[1]
            padded = torch.zeros(words * 32, dtype=torch.int64)
            padded[: allowed.numel()] = allowed.to(torch.int64)
            bits = (padded.view(words, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
            self._no_control = bits.to(torch.int64).where(bits < 2**31, bits - 2**32).to(torch.int32)
        return self._no_control


class RequestGrammar:
    """One constrained request's grammar state: the xgrammar matcher, and a token mask its
    bitmask rows are ANDed with (None: none). `num_accepted` counts the generated tokens it
    accepted; `terminated_at` is that count when the grammar ended (None: not ended), so the
    token that ended it is known among several a step emits (speculative decoding)."""

    def __init__(self, matcher: Any, allowed: Any = None) -> None:
        self.matcher = matcher
        self.allowed = allowed
        self.num_accepted = 0
        self.terminated_at: int | None = None

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept_token(self, token: int) -> bool:
        ok = self.matcher.accept_token(token)
        if ok:
            self.num_accepted += 1
            if self.terminated_at is None and self.matcher.is_terminated():
                self.terminated_at = self.num_accepted
        return ok

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.matcher.stop_token_ids)
