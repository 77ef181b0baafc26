"""The step cost model behind time-budgeted steps (`Engine.step(budget_ms=...)`,
`SchedulerConfig(step_budget_ms=...)`; docs/step_budget.md).

A step's duration is modelled as linear in what its batch holds:

    ms = fixed + per_seq * sequences + per_token * tokens + per_kpair * attention pairs / 1000

(`pairs`: each token attends to every position up to its own). The batch manager cuts context
chunks so that the predicted time of the batch fits the budget (pyengine/step_cost.h). The
coefficients are fitted at start-up from a few timed dummy batches (`calibrate`) and corrected
from every step's measured time by recursive least squares with forgetting (`OnlineStepCost`),
so the model follows what the machine actually does (other load, caches, larger batches than
the calibration's).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import astuple
from typing import TYPE_CHECKING

import numpy as np
import torch

from pyengine.config import StepCostModel

if TYPE_CHECKING:
    from pyengine.core import CoreBatchManager
    from pyengine.runtime.model_runner import ModelRunner

logger = logging.getLogger("pyengine")


def features(seqs: int, tokens: int, pairs: int) -> np.ndarray:
    """The model's regressors for one batch: (1, sequences, tokens, pairs / 1000)."""
    return np.array([1.0, seqs, tokens, pairs * 1e-3])


def batch_shape(query_start_loc, seq_lens, num_seqs: int) -> tuple[int, int, int]:
    """(sequences, tokens, attention pairs) of a scheduled batch, from its metadata: sequence i
    computes c = query_start_loc[i+1] - query_start_loc[i] tokens ending at position seq_lens[i],
    c * (seq_lens[i] - c) + c * (c + 1) / 2 pairs (as chunk_attention_pairs in step_cost.h)."""
    q = np.asarray(query_start_loc[:num_seqs + 1], dtype=np.int64)
    chunks = np.diff(q)
    starts = np.asarray(seq_lens[:num_seqs], dtype=np.int64) - chunks
    pairs = int(np.sum(chunks * starts + chunks * (chunks + 1) // 2))
    return num_seqs, int(q[-1] - q[0]), pairs


def fit(rows: list[tuple[int, int, int]], times_ms: list[float]) -> StepCostModel:
    """Least squares with every coefficient >= 0: a coefficient that comes out negative is
    fixed at 0 and the rest refitted."""
    x = np.array([features(*r) for r in rows])
    y = np.array(times_ms)
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(x[:, free], y, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return StepCostModel(*(float(c) for c in coef))


class OnlineStepCost:
    """The cost model corrected from measured steps: recursive least squares on
    (1, sequences, tokens, kpairs) -> ms, with forgetting factor `forgetting` (an observation's
    weight halves after about 0.69 / (1 - forgetting) steps), starting from `prior` with the
    confidence of `prior_weight` observations. `model` is the current fit with negative
    coefficients clipped to 0 (what the batch manager takes)."""

    def __init__(self, prior: StepCostModel, forgetting: float = 0.98, prior_weight: float = 4.0) -> None:
        self.theta = np.array(astuple(prior), dtype=np.float64)
        # P: the inverse information matrix. Each regressor's prior variance is scaled by its
        # typical size squared (tokens run to thousands, kpairs to millions), so that no column
        # moves on its own when the data do not excite it.
        scale = np.array([1.0, 16.0, 256.0, 1024.0])
        self.P = np.diag(1.0 / (prior_weight * scale ** 2))
        self.forgetting = forgetting
        self.steps = 0

    def observe(self, seqs: int, tokens: int, pairs: int, ms: float) -> None:
        x = features(seqs, tokens, pairs)
        px = self.P @ x
        gain = px / (self.forgetting + x @ px)
        self.theta = self.theta + gain * (ms - x @ self.theta)
        self.P = (self.P - np.outer(gain, px)) / self.forgetting
        self.steps += 1

    @property
    def model(self) -> StepCostModel:
        return StepCostModel(*(max(0.0, float(c)) for c in self.theta))


# ---- start-up calibration ----------------------------------------------------------------------

# Request ids of the calibration's dummy requests (removed before any user request arrives).
_DUMMY_ID = -(2 ** 62)


def calibration_shapes(max_batch_size: int, max_num_tokens: int, max_seq_len: int,
                       tokens_per_block: int) -> list[list[int]]:
    """Prompt lengths of the dummy batches, one list per batch: one 1-token sequence, a batch of
    1-token sequences, and single prefills of two lengths (a quarter and all of a chunk of up to
    256 tokens) -- shapes that separate the four coefficients."""
    rows = max(2, min(max_batch_size, 16, max_num_tokens))
    chunk = max(2, min(max_num_tokens, 256, max_seq_len - 1))
    return [[1], [1] * rows, [max(1, chunk // 4)], [chunk]]


def calibrate(bm: CoreBatchManager, runner: ModelRunner, shapes: list[list[int]], repeats: int = 2) -> StepCostModel:
    """Times one forward of each shape (the best of `repeats`, after one untimed run) through the
    engine's own batch manager and runner, then undoes each batch (rollback, and the dummy
    requests leave the queue): the pools are as before. Returns the fitted model."""
    rows: list[tuple[int, int, int]] = []
    times: list[float] = []
    for prompts in shapes:
        ids = [_DUMMY_ID + i for i in range(len(prompts))]
        for rid, n in zip(ids, prompts):
            bm.add_request(rid, np.ones(n, dtype=np.int32), 1, reuse_prefix=False)
        try:
            elapsed = []
            for _ in range(repeats + 1):
                num_tokens, num_seqs, num_logits = bm.schedule(0.0)
                try:
                    shape = batch_shape(runner.query_start_loc, runner.seq_lens, num_seqs)
                    t0 = time.perf_counter()
                    runner.forward(num_tokens, num_seqs, num_logits)
                    if runner.is_cuda:
                        torch.cuda.synchronize(runner.device)
                    elapsed.append(time.perf_counter() - t0)
                finally:
                    bm.rollback()
            rows.append(shape)
            times.append(min(elapsed[1:]) * 1e3)  # the first run warms up
        finally:
            for rid in ids:
                if not bm.remove_waiting(rid):
                    raise RuntimeError(f"step cost calibration: dummy request {rid} did not leave the queue")
    model = fit(rows, times)
    logger.info("pyengine: step cost model %s (from %s)", model.as_dict(),
                ", ".join(f"{r} -> {t:.2f} ms" for r, t in zip(rows, times)))
    return model
