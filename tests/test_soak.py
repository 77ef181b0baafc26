"""The randomized soak (tests/soak_ops.py), CI-sized: the same random operations — add
(greedy and seeded sampling with random parameters, stop strings and tokens, logprobs,
prompt logprobs, priorities, cache salts, logits processors), abort in every state, step,
injected forward and logits-processor faults, invalid requests — on an engine without
and one with overlap, over a small KV pool under max_utilization with chunked prefill.
Every invariant is checked after every operation and every request's final output is
compared between the two. bench/soak.py runs the same soak for 100,000 operations."""

from __future__ import annotations

import pytest

from soak_ops import SoakConfig, run_soak

NUM_OPS = 1500


@pytest.mark.parametrize("seed, queue_policy", [(101, "priority"), (202, "fcfs"), (303, "priority")])
def test_overlap_soak_matches_plain(llama_dir, seed, queue_policy):
    result = run_soak(llama_dir, seed, NUM_OPS, {"plain": False, "overlap": True},
                      SoakConfig(queue_policy=queue_policy))
    plain, over = result.runs["plain"], result.runs["overlap"]
    assert result.compared == plain.num_added == over.num_added > 100
    # The soak did what it is for, in both engines.
    for run in (plain, over):
        c = run.counts
        assert all(c.finished[reason] > 0 for reason in ("stop", "length", "abort")), c.finished
        assert run.faults.fired["forward"] > 0 and run.faults.fired["processor"] > 0
        assert c.failed_steps == sum(run.faults.fired.values())
        for kind in ("no_output", "streaming"):
            assert c.aborts[(kind, "accepted")] > 0, c.aborts
        assert c.aborts[("unknown", "refused")] + c.aborts[("finished", "refused")] > 0
    assert plain.counts.aborts[("just_finished", "refused")] > 0
