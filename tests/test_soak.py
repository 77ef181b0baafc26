"""The randomized soak (tests/soak_ops.py), CI-sized: the same random operations — add
(greedy and seeded sampling with random parameters, stop strings and tokens, logprobs,
prompt logprobs, priorities, cache salts, logits processors), abort in every state, step,
injected faults (the forward, a logits processor, the batch manager's schedule at each of
its points, a real Ctrl-C during the forward, the sampler, the update or the outputs),
invalid requests — on an engine without and one with overlap, over a small KV pool under
max_utilization with chunked prefill.
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
        assert all(run.faults.fired[kind] > 0 for kind in ("forward", "processor", "schedule", "interrupt"))
        # every fault fired in a step that raised (checked step by step); a step may fire several
        assert 0.8 * sum(run.faults.fired.values()) <= c.failed_steps + c.interrupted_steps <= \
            sum(run.faults.fired.values())
        assert 0 < c.interrupted_steps <= run.faults.fired["interrupt"]
        for kind in ("no_output", "streaming"):
            assert c.aborts[(kind, "accepted")] > 0, c.aborts
        assert c.aborts[("unknown", "refused")] + c.aborts[("finished", "refused")] > 0
    assert plain.counts.aborts[("just_finished", "refused")] > 0
