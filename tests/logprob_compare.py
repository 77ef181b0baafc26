"""Comparing logprobs of two runs whose batches differ in shape.

A row's logits can differ in their last float bits between batches of other shapes (the linear
kernels sum in a different order at different row counts), so logprobs compare with a small
absolute tolerance; which tokens appear, and in which positions, compare exactly. Rounding both
sides to a fixed number of decimals instead fails whenever a value sits at a rounding boundary.
"""

from __future__ import annotations

import math
from typing import Any

LOGPROB_ABS_TOL = 1e-4


def assert_logprobs_close(a: list[dict[int, float] | None] | None, b: list[dict[int, float] | None] | None,
                          abs_tol: float = LOGPROB_ABS_TOL) -> None:
    """Per-position logprob dicts (or None) with the same tokens and values within abs_tol."""
    assert (a is None) == (b is None), (a, b)
    if a is None:
        return
    assert len(a) == len(b), (len(a), len(b))
    for i, (da, db) in enumerate(zip(a, b)):
        assert (da is None) == (db is None), (i, da, db)
        if da is None:
            continue
        assert da.keys() == db.keys(), (i, da, db)
        for t in da:
            assert math.isclose(da[t], db[t], rel_tol=0.0, abs_tol=abs_tol), (i, t, da[t], db[t])


def assert_same_finals(a: dict[Any, tuple], b: dict[Any, tuple]) -> None:
    """Dicts of final outputs as (token ids, finish reason, text, logprobs, prompt logprobs), or of
    other values: everything but the logprobs equal, the logprobs close."""
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    for k in a:
        if not isinstance(a[k], tuple):
            assert a[k] == b[k], (k, a[k], b[k])
            continue
        assert len(a[k]) == len(b[k]) and a[k][:3] == b[k][:3], (k, a[k][:3], b[k][:3])
        for lp_a, lp_b in zip(a[k][3:], b[k][3:]):
            assert_logprobs_close(lp_a, lp_b)
