"""The step cost model behind time-budgeted steps (`Engine.step(budget_ms=...)`,
`SchedulerConfig(step_budget_ms=...)`; docs/step_budget.md).

A step's duration is modelled as linear in what its batch holds:

    ms = fixed + per_seq * sequences + per_token * tokens + per_kpair * attention pairs / 1000

(`pairs`: each token attends to every position up to its own). The batch manager cuts context
chunks so that the predicted time of the batch fits the budget (pyengine/step_cost.h). The
coefficients are fitted at start-up from a few timed dummy batches (`calibrate`) and corrected
from every step's measured time by a forgetting least-squares fit anchored to the start-up one
(`OnlineStepCost`), so the model follows what the machine actually does (other load, caches,
larger batches than the calibration's); a margin from the recent prediction errors keeps
overruns rare.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
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


def _nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0 (a: rows x coefficients) by dropping the most negative
    coefficient and refitting the rest until none is negative (exact for the few, mostly
    well-separated coefficients here)."""
    free = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while free:
        sol, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free.pop(int(np.argmin(sol)))
    return coef


def fit(rows: list[tuple[int, int, int]], times_ms: list[float]) -> StepCostModel:
    """Least squares with every coefficient >= 0: a coefficient that comes out negative is
    fixed at 0 and the rest refitted."""
    coef = _nonnegative_solve(np.array([features(*r) for r in rows]), np.array(times_ms))
    return StepCostModel(*(float(c) for c in coef))


# OnlineStepCost folds its queue of observed steps at least this often (a bound on the queue).
_FOLD_EVERY = 256

# Typical magnitudes of the regressors (1, sequences, tokens, kpairs): the prior counts as
# `prior_weight` observations of this size along each coefficient.
_REGRESSOR_SCALE = np.array([1.0, 16.0, 256.0, 1024.0])


class OnlineStepCost:
    """The cost model corrected from measured steps.

    The fit: exponentially weighted least squares (an observation's weight halves after about
    0.69 / (1 - forgetting) steps) anchored by a ridge term that does not decay, worth
    `prior_weight` observations per coefficient. The anchor is the start-up model `prior` times
    a speed factor (the least-squares ratio of measured times to the prior's predictions, with
    the same forgetting): a machine that becomes uniformly slower or faster moves every
    coefficient, not only the ones recent steps excite. The anchor keeps the fit sane where the
    steps do not tell the coefficients apart: decode-only steps have as many tokens as
    sequences, and plain recursive least squares with forgetting let such directions drift
    without bound (it moved the whole fixed cost into the per-sequence one, which then
    over-priced every prompt chunk). Negative coefficients are fixed at 0 and the rest refitted.

    The margin: the scheduler is given the fit scaled by `margin`, the `quantile` of the
    ratios measured / predicted by the current fit over the last `window` steps (at least 1),
    so that steps overrun the budget about as rarely as that quantile says, whatever the
    machine's noise (other processes, caches, the allocator). The steps are the budget-bound
    ones (a budget set, and prompt tokens or drafts it priced) once there are `min_ratios` of
    them, else every step: a linear fit errs differently on a 1,500-token prefill or a
    decode-only step than on the steps a budget cuts, and the margin only matters for those.
    The ratios are taken against the current fit, not the one each step was priced with: while
    the fit moves to a new regime (the first budgeted steps after unbudgeted ones) the errors
    of the fits it left behind are not the current one's. (With every step's ratio, each
    against the fit it was priced with, the margin stayed at 1.15-1.45 for a hundred budgeted
    steps after an unbudgeted run, leaving a sixth of each budget unused.) `model` is the fit,
    `scheduled` what the batch manager takes.

    `observe` only queues the step: the queue is folded into the sums (in order, so the results
    are those of folding each step as it comes), the fit solved and the margin's quantile taken
    when they are read, or every `_FOLD_EVERY` steps, so an engine that never runs a budgeted step
    pays almost nothing per step. (Solving on every step cost ~0.3 ms, 3-5% of a batch-1 decode
    step; even folding one step's small numpy updates cost ~0.12 ms there, against ~5 us in a
    loop: a step runs them with the caches cold from the forward's weight stream.)
    """

    def __init__(self, prior: StepCostModel, forgetting: float = 0.98, prior_weight: float = 4.0,
                 quantile: float = 0.9, window: int = 100, min_ratios: int = 16) -> None:
        self._theta0 = np.array(astuple(prior), dtype=np.float64)
        self._ridge = np.diag(prior_weight * _REGRESSOR_SCALE ** 2)
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        # the speed factor s: least squares of measured on the start-up model's predictions
        self._pp = 0.0
        self._py = 0.0
        self._theta = self._theta0
        self._solved = True
        self.forgetting = forgetting
        self.quantile, self.window, self.min_ratios = quantile, window, min_ratios
        # the last `window` steps (regressors, measured ms), all and budget-bound ones
        self._recent: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._recent_bound: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._margin: float | None = 1.0  # None: to be recomputed
        self._queued: list[tuple[int, int, int, float, bool]] = []  # observed, not yet folded
        self.steps = 0
        self.bound_steps = 0

    def observe(self, seqs: int, tokens: int, pairs: int, ms: float, budget_bound: bool = False) -> None:
        """One measured step; `budget_bound`: it ran under a budget that priced some of its
        tokens (prompt chunks or drafts, not only one token per generation row)."""
        self._queued.append((seqs, tokens, pairs, ms, budget_bound))
        self.steps += 1
        self.bound_steps += budget_bound
        if len(self._queued) >= _FOLD_EVERY:
            self._fold()

    def _fold(self) -> None:
        """The queued steps into the sums and the recent windows, one after another."""
        queued, self._queued = self._queued, []
        for seqs, tokens, pairs, ms, budget_bound in queued:
            x = features(seqs, tokens, pairs)
            self._recent.append((x, ms))
            if budget_bound:
                self._recent_bound.append((x, ms))
            self._xx = self.forgetting * self._xx + np.outer(x, x)
            self._xy = self.forgetting * self._xy + x * ms
            prior_ms = float(x @ self._theta0)
            self._pp = self.forgetting * self._pp + prior_ms * prior_ms
            self._py = self.forgetting * self._py + prior_ms * ms
        if queued:
            self._solved = False
            self._margin = None

    @property
    def changed(self) -> bool:
        """Whether steps were observed since the fit was last solved."""
        return not self._solved or bool(self._queued)

    @property
    def theta(self) -> np.ndarray:
        """The coefficients (fixed, per_seq, per_token, per_kpair), solved on demand."""
        self._fold()
        if not self._solved:
            speed = self._py / self._pp if self._pp > 0 else 1.0
            # the normal equations (ridge towards speed * prior, + data) as a least-squares
            # system: a^T a = A, a^T b = c
            a = np.linalg.cholesky(self._ridge + self._xx).T
            c = self._ridge @ (speed * self._theta0) + self._xy
            self._theta = _nonnegative_solve(a, np.linalg.solve(a.T, c))
            self._solved = True
        return self._theta

    @property
    def margin(self) -> float:
        """max(1, the quantile of measured / predicted by the current fit over the recent
        budget-bound steps, or over every recent step while fewer than min_ratios were
        budget-bound); 1 until min_ratios steps were observed."""
        self._fold()
        if self._margin is None:
            recent = self._recent_bound if len(self._recent_bound) >= self.min_ratios else self._recent
            self._margin = 1.0
            if len(recent) >= self.min_ratios:
                predicted = np.array([x for x, _ in recent]) @ self.theta
                measured = np.array([ms for _, ms in recent])
                ok = predicted > 0
                if ok.any():
                    self._margin = max(1.0, float(np.quantile(measured[ok] / predicted[ok], self.quantile)))
        return self._margin

    @property
    def model(self) -> StepCostModel:
        return StepCostModel(*(max(0.0, float(c)) for c in self.theta))

    @property
    def scheduled(self) -> StepCostModel:
        """The fit scaled by the margin: what the batch manager prices batches with."""
        return StepCostModel(*(max(0.0, float(c)) * self.margin for c in self.theta))


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
                    shape = bm.scheduled_shape()
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
