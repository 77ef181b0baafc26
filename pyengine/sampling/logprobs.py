"""Log-probabilities returned with outputs: the top-N of a row of the model's raw distribution
plus the chosen (or actual) token, for generated tokens and for prompt tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pyengine.engine.outputs import RequestRecord


def top_logprobs(row: torch.Tensor, n: int, chosen: int) -> dict[int, float]:
    """{token: logprob} of the top-n tokens of a log-softmax row plus the chosen token."""
    out: dict[int, float] = {}
    if n > 0:
        values, ids = row.topk(n)
        out = dict(zip(ids.tolist(), values.tolist()))
    out[chosen] = float(row[chosen])
    return out


PromptRows = tuple[torch.Tensor, list[tuple["RequestRecord", int]]]


def prompt_logprob_rows(records: list["RequestRecord | None"], query_start_loc: list[int],
                        seq_lens: list[int]) -> PromptRows | None:
    """The token rows of a batch whose logits give prompt logprobs still owed: (row indices,
    [(request, position)]). `records[s]` is sequence s's request (None: it wants none)."""
    rows: list[int] = []
    owners: list[tuple[RequestRecord, int]] = []
    for s, rec in enumerate(records):
        if rec is None or not rec.wants_prompt_logprobs:
            continue
        first_pos = seq_lens[s] - (query_start_loc[s + 1] - query_start_loc[s])
        owed_from = len(rec.prompt_logprobs) - 1  # position whose row predicts the next owed token
        for row in range(query_start_loc[s], query_start_loc[s + 1]):
            pos = first_pos + row - query_start_loc[s]
            if owed_from <= pos < len(rec.prompt_token_ids) - 1:
                rows.append(row)
                owners.append((rec, pos))
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.int32), owners


def record_prompt_logprobs(logits: torch.Tensor, owners: list[tuple["RequestRecord", int]]) -> int:
    """Appends each owner's prompt logprob from its logits row; returns how many requests are
    now owed nothing more."""
    logprobs = torch.log_softmax(logits, dim=-1)
    completed = 0
    for i, (rec, pos) in enumerate(owners):
        rec.prompt_logprobs.append(top_logprobs(logprobs[i], rec.params.prompt_logprobs,
                                                rec.prompt_token_ids[pos + 1]))
        if not rec.wants_prompt_logprobs:
            completed += 1
    return completed
