"""The online correction of the step cost model (pyengine.engine.step_cost.OnlineStepCost) on
synthetic step times: it stays anchored where the steps do not tell the coefficients apart, it
follows a machine that changes speed, and its margin tracks the spread of the current fit's
errors over the steps a budget cut."""

from __future__ import annotations

import numpy as np
import pytest

from pyengine import StepCostModel
from pyengine.engine.step_cost import OnlineStepCost, fit

TRUE = StepCostModel(fixed_ms=20.0, per_seq_ms=0.5, per_token_ms=0.15, per_kpair_ms=0.002)


def decode_step(rng: np.random.Generator) -> tuple[int, int, int]:
    seqs = int(rng.integers(1, 9))
    context = int(rng.integers(50, 400))
    return seqs, seqs, seqs * context


def prefill_step(rng: np.random.Generator) -> tuple[int, int, int]:
    chunk = int(rng.integers(1, 9)) * 16
    seqs = int(rng.integers(0, 5))
    return seqs + 1, seqs + chunk, seqs * 200 + chunk * (chunk + 1) // 2


def test_decode_only_steps_do_not_move_the_fixed_cost_into_the_per_sequence_one():
    # Decode-only steps have tokens == sequences: (per_seq, per_token) are not separable and,
    # with few sequences, neither is the fixed cost. Plain forgetting RLS let them drift; the
    # anchored fit keeps pricing a prompt chunk as the start-up model did.
    rng = np.random.default_rng(0)
    online = OnlineStepCost(TRUE)
    for _ in range(2000):
        shape = decode_step(rng)
        online.observe(*shape, TRUE.predict_ms(*shape) * rng.uniform(0.97, 1.03))
    prefill = (1, 256, 256 * 257 // 2)
    assert online.model.predict_ms(*prefill) == pytest.approx(TRUE.predict_ms(*prefill), rel=0.05)
    assert online.model.fixed_ms == pytest.approx(TRUE.fixed_ms, rel=0.1)
    for shape in [decode_step(rng) for _ in range(20)]:
        assert online.model.predict_ms(*shape) == pytest.approx(TRUE.predict_ms(*shape), rel=0.03)


def test_the_fit_follows_a_machine_that_slows_down():
    rng = np.random.default_rng(1)
    online = OnlineStepCost(TRUE)
    slow = StepCostModel(*(2 * c for c in (TRUE.fixed_ms, TRUE.per_seq_ms, TRUE.per_token_ms, TRUE.per_kpair_ms)))
    for i in range(400):
        shape = decode_step(rng) if i % 3 else prefill_step(rng)
        online.observe(*shape, slow.predict_ms(*shape))
    for shape in [decode_step(rng) for _ in range(10)] + [prefill_step(rng) for _ in range(10)]:
        assert online.model.predict_ms(*shape) == pytest.approx(slow.predict_ms(*shape), rel=0.05)
    assert online.steps == 400


def _ratios_to_current_fit(online: OnlineStepCost, steps: list[tuple[tuple[int, int, int], float]]) -> np.ndarray:
    return np.array([ms / online.model.predict_ms(*shape) for shape, ms in steps])


def test_the_margin_is_the_recent_quantile_of_measured_over_the_current_fit():
    rng = np.random.default_rng(2)
    online = OnlineStepCost(TRUE)
    steps = []
    for i in range(150):
        shape = decode_step(rng)
        ms = TRUE.predict_ms(*shape) * (1.0 + 0.3 * rng.random())  # 0-30 % over the truth
        steps.append((shape, ms))
        online.observe(*shape, ms)
        if i < 15:
            assert online.margin == 1.0  # too few steps yet
    # the last 100 steps' ratios, each against the fit as it is now
    expected = np.quantile(_ratios_to_current_fit(online, steps[-100:]), 0.9)
    assert expected > 1.05
    assert online.margin == pytest.approx(expected, rel=1e-9)
    scheduled, model = online.scheduled, online.model
    assert scheduled.fixed_ms == pytest.approx(model.fixed_ms * online.margin)
    assert scheduled.per_token_ms == pytest.approx(model.per_token_ms * online.margin)
    # steps faster than predicted never shrink the margin below 1
    for _ in range(100):
        shape = decode_step(rng)
        online.observe(*shape, TRUE.predict_ms(*shape) * 0.5)
    assert online.margin == 1.0


def test_the_margin_comes_from_the_budget_bound_steps_once_there_are_enough():
    # Unbudgeted steps that the linear model fits badly (0-40 % over it), then budget-bound ones
    # it fits within 1 %: from the 16th budget-bound step on, only those set the margin.
    rng = np.random.default_rng(5)
    online = OnlineStepCost(TRUE)
    everything, bound = [], []
    for _ in range(100):
        shape = decode_step(rng)
        ms = TRUE.predict_ms(*shape) * (1.0 + 0.4 * rng.random())
        everything.append((shape, ms))
        online.observe(*shape, ms)
    wide = online.margin
    assert wide > 1.1
    for i in range(40):
        shape = prefill_step(rng)
        ms = TRUE.predict_ms(*shape) * rng.uniform(0.99, 1.01)
        everything.append((shape, ms))
        bound.append((shape, ms))
        online.observe(*shape, ms, budget_bound=True)
        window = bound if len(bound) >= 16 else everything[-100:]
        assert online.margin == pytest.approx(max(1.0, np.quantile(_ratios_to_current_fit(online, window), 0.9)),
                                              rel=1e-9), i
        if i < 15:
            assert online.margin > 1.08  # still every step's spread
    assert online.margin < 1.05
    # unbudgeted steps after them leave the budget-bound window as it was
    for _ in range(30):
        shape = decode_step(rng)
        online.observe(*shape, TRUE.predict_ms(*shape) * (1.0 + 0.4 * rng.random()))
    assert online.margin == pytest.approx(max(1.0, np.quantile(_ratios_to_current_fit(online, bound), 0.9)),
                                          rel=1e-9)


def test_fit_keeps_every_coefficient_nonnegative():
    # times that a plain least-squares fit would explain with a negative per-sequence cost
    rows = [(1, 1, 10), (8, 8, 80), (1, 64, 2080), (4, 100, 5000), (2, 2, 500)]
    times = [10.0, 9.0, 30.0, 40.0, 10.0]
    model = fit(rows, times)
    assert min(model.fixed_ms, model.per_seq_ms, model.per_token_ms, model.per_kpair_ms) >= 0.0
    unconstrained, *_ = np.linalg.lstsq(np.array([[1, s, t, p * 1e-3] for s, t, p in rows]), np.array(times),
                                        rcond=None)
    assert unconstrained.min() < 0  # the case is one the constraint matters for


def test_observing_only_accumulates_and_the_fit_solved_on_demand_is_the_same():
    # observe() must stay cheap for engines that never budget a step: the fit is solved when read,
    # and solving once after many steps gives what solving after every step gives.
    rng = np.random.default_rng(4)
    lazy, eager = OnlineStepCost(TRUE), OnlineStepCost(TRUE)
    for i in range(300):
        shape = decode_step(rng) if i % 4 else prefill_step(rng)
        ms = TRUE.predict_ms(*shape) * 1.5 * rng.uniform(0.95, 1.05)
        lazy.observe(*shape, ms)
        eager.observe(*shape, ms)
        assert lazy.changed and eager.changed
        eager.theta
        assert not eager.changed
    assert lazy.steps == eager.steps == 300
    np.testing.assert_allclose(lazy.theta, eager.theta, rtol=1e-12)
    assert not lazy.changed
    assert lazy.model.predict_ms(1, 256, 256 * 257 // 2) == pytest.approx(
        1.5 * TRUE.predict_ms(1, 256, 256 * 257 // 2), rel=0.05)
    # the margin is taken against the current fit, so it does not depend on when the fit was
    # solved either; the fit follows the 1.5x slower steps, leaving their U(0.95, 1.05) spread
    assert lazy.margin == pytest.approx(eager.margin, rel=1e-12)
    assert lazy.margin == pytest.approx(1.04, abs=0.02)
