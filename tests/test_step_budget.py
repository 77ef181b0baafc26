"""Time-budgeted steps (Engine.step(budget_ms=...), SchedulerConfig(step_budget_ms=...)): outputs
do not depend on the budget, prompt chunks follow the step cost model exactly (an injected,
fixed model), the model is calibrated at start-up and corrected from measured steps, and bad
budgets are refused before anything changes. The C++ scheduler's exact chunking:
tests/cpp/test_step_budget.cpp."""

from __future__ import annotations

import math

import pytest

from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig, StepCostModel

PROMPTS = [list(range(3, 3 + n)) for n in (70, 9, 45, 33, 100, 5)]


def make_engine(model_dir, overlap=False, policy="guaranteed_no_evict", max_tokens=2048, **sc) -> Engine:
    return Engine(model_dir, max_seq_len=160, seed=0, overlap=overlap,
                  kv_cache_config=KvCacheConfig(max_tokens=max_tokens, tokens_per_block=8),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=64,
                                                   capacity_scheduler_policy=policy, **sc))


def run(engine: Engine, budget_ms: float | None, seeded: bool) -> dict[str, list[int]]:
    """Every prompt to completion (greedy, and seeded sampling for every other request);
    request id -> tokens."""
    for i, p in enumerate(PROMPTS):
        params = (SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=12, ignore_eos=True)
                  if seeded and i % 2 else SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        engine.add_request(p, params, request_id=f"r{i}")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step(budget_ms):
            if out.finished:
                tokens[out.request_id] = out.token_ids
    engine.check_resources()
    return tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_outputs_do_not_depend_on_the_budget(llama_dir, overlap, policy):
    # max_utilization with a small pool pauses and recomputes requests (preemption)
    max_tokens = 2048 if policy == "guaranteed_no_evict" else 160
    reference = run(make_engine(llama_dir, overlap, policy, max_tokens), None, seeded=True)
    assert len(reference) == len(PROMPTS)
    model = StepCostModel(fixed_ms=1.0, per_token_ms=0.1)
    for budget in (2.0, 3.5, 8.0):
        engine = make_engine(llama_dir, overlap, policy, max_tokens, step_cost_model=model)
        tokens = run(engine, budget, seeded=True)
        assert tokens == reference, f"budget {budget} ms"


def test_a_fixed_cost_model_sets_the_chunks(llama_dir):
    # 1 ms + 0.1 ms a token, budget 3.5 ms: 25 tokens, so prompt chunks of 24 (three 8-token
    # blocks) when nothing generates; the configured budget applies to every step.
    engine = make_engine(llama_dir, step_cost_model=StepCostModel(fixed_ms=1.0, per_token_ms=0.1),
                         step_budget_ms=3.5)
    engine.add_request(list(range(3, 73)), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    sizes = []
    while engine.has_unfinished_requests():
        engine.step()
        q = engine._runner.query_start_loc.tolist()
        sizes.append(q[1] - q[0])
    assert sizes == [24, 24, 22, 1]
    report = engine.step_cost_model()
    assert report["source"] == "configured" and report["steps_observed"] == 0
    assert (report["fixed_ms"], report["per_token_ms"]) == (1.0, 0.1)  # never refitted
    # a per-call budget overrides the configured one
    engine.add_request(list(range(100, 170)), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    engine.step(budget_ms=7.5)  # 65 tokens fit: the 64-token limit, in whole blocks
    q = engine._runner.query_start_loc.tolist()
    assert q[1] - q[0] == 64
    while engine.has_unfinished_requests():
        engine.step()


def test_the_model_is_calibrated_at_start_up_and_corrected_by_steps(llama_dir):
    engine = make_engine(llama_dir)
    report = engine.startup_report()["step_cost_model"]
    assert report["source"] == "calibrated" and report["steps_observed"] == 0
    assert all(math.isfinite(v) and v >= 0 for v in report["startup"].values())
    assert report["startup"]["fixed_ms"] + report["startup"]["per_token_ms"] > 0
    engine.check_resources()  # the dummy batches left nothing behind
    assert engine._bm.num_waiting == 0 and not engine._bm.has_unfinished()
    out = engine.generate([list(range(3, 40))], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)
    assert len(out[0].token_ids) == 6
    report = engine.step_cost_model()
    assert report["steps_observed"] >= 6 and report["budget_bound_steps"] == 0  # no budget
    # budgeted steps: those that computed prompt tokens are budget-bound (their errors set the
    # margin), the decode-only ones are not
    observed = report["steps_observed"]
    engine.add_request(list(range(3, 103)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    prompt_steps = steps = 0
    while engine.has_unfinished_requests():
        engine.step(budget_ms=1e6)
        q = engine._runner.query_start_loc.tolist()
        prompt_steps += q[1] - q[0] > 1
        steps += 1
    report = engine.step_cost_model()
    assert prompt_steps == 2 and steps == 4  # 100 tokens in chunks of 64 and 36, then 2 decode steps
    assert report["steps_observed"] == observed + 4 and report["budget_bound_steps"] == 2


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_a_bad_budget_is_refused_before_anything_changes(llama_dir, bad):
    engine = make_engine(llama_dir, step_cost_model=StepCostModel(fixed_ms=1.0))
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    with pytest.raises(ValueError, match=r"budget_ms must be a positive number of milliseconds, got"):
        engine.step(budget_ms=bad)
    assert engine._bm.num_active == 0 and engine._bm.num_waiting == 1  # nothing scheduled
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [len(o.token_ids) for o in outs if o.finished] == [1]


def test_bad_configuration_values_are_named():
    with pytest.raises(ValueError, match=r"step_budget_ms must be a positive number of milliseconds, got -2"):
        SchedulerConfig(step_budget_ms=-2)
    with pytest.raises(ValueError, match=r"StepCostModel.per_kpair_ms must be a finite number >= 0, got nan"):
        StepCostModel(per_kpair_ms=float("nan"))
    with pytest.raises(ValueError, match=r"step_cost_model must be a StepCostModel or None"):
        SchedulerConfig(step_cost_model={"fixed_ms": 1.0})
