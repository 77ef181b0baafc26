"""Incremental detokenization: text grows token by token without ever emitting half of a
multi-byte character (a decode ending in U+FFFD waits for the next token)."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the window decoded for context
        self._read_offset = 0    # ids before this have been turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Appends tokens; returns the text they completed."""
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        if final:  # the last step: the exact decode of everything
            full = self._decode(self.ids)
            delta = full[len(self.text):] if full.startswith(self.text) else ""
            self.text = full
            return delta
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith("\ufffd"):
            return ""
        delta = window[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        self.text += delta
        return delta
