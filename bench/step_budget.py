"""Time-budgeted steps: W1-reduced with requests arriving over time (Poisson), so prompts and
decode rows mix in the same steps. Runs of the same arrival schedule on one engine:

1. no budget (the p99 step time for contrast, and the throughput reference);
2. the median decode-only step of run 1 measured, then budget = 1.5 x that median;
3. with that budget: p99 step time against budget x 1.1, throughput against run 1's;
4. with --repeats N (default 3), N pairs of runs (unbudgeted, budgeted) alternating, the
   budget fixed from the first pair: each pair's figures and the medians (a 2-core machine's
   run-to-run spread, +-5%, is as large as what is being measured).

Arrivals are simulated on the engine's own clock: before each step, every request whose
arrival time (a Poisson process, mean rate --rate requests/s) has passed is added. Greedy
outputs of the budgeted run are compared with the unbudgeted run's (they must be equal).

    python bench/step_budget.py
    python bench/step_budget.py --quick     # 16 requests
    python bench/step_budget.py --repeats 1 # one pair of runs
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def run(engine, requests, arrivals: list[float], budget_ms: float | None):
    """Drives the engine until every request has finished; returns (step times in ms with
    whether the step computed prompt tokens, wall seconds, tokens by request)."""
    from pyengine import SamplingParams

    steps: list[tuple[float, bool]] = []
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    nxt = 0
    while nxt < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while nxt < len(requests) and arrivals[nxt] <= now:
            r = requests[nxt]
            engine.add_request(r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                                  ignore_eos=True), request_id=f"r{nxt}")
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        t0 = time.perf_counter()
        outs = engine.step(budget_ms)
        ms = (time.perf_counter() - t0) * 1e3
        steps.append((ms, _has_prompt_rows(engine)))
        for o in outs:
            if o.finished:
                tokens[o.request_id] = o.token_ids
    return steps, time.perf_counter() - start, tokens


def _has_prompt_rows(engine) -> bool:
    """Whether the last step computed any prompt chunk (a sequence with more than one token)."""
    q = engine._runner.query_start_loc.tolist()
    n = engine._loop._step_batch.num_seqs if engine._loop._step_batch is not None else 0
    return any(q[i + 1] - q[i] > 1 for i in range(n))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--quick", action="store_true", help="16 requests")
    p.add_argument("--rate", type=float, default=8.0, help="mean arrivals per second (default 8)")
    p.add_argument("--factor", type=float, default=1.5, help="budget = factor x median decode-only step")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs, alternating (default 3)")
    args = p.parse_args(argv)
    common.set_threads()
    n = 16 if args.quick else 32
    requests = common.w1_requests(n, (32, 256), (16, 128))
    rng = random.Random(1)
    t, arrivals = 0.0, []
    for _ in requests:
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    model_dir = common.smollm_checkpoint()
    engine = common.w1_engine(model_dir, args.dtype, requests)
    print(f"step budget — {args.dtype}, {common.cpu_model()}; {n} requests, Poisson {args.rate}/s")
    run(engine, requests[:4], [0.0] * 4, None)  # warm-up
    gen = sum(r.max_tokens for r in requests)
    budget = None
    pairs = []
    same = True
    print("| pair | run | steps | p50 step ms | p99 step ms | max step ms | generated tok/s |")
    print("|---|---|---|---|---|---|---|")
    for i in range(max(1, args.repeats)):
        base_steps, base_wall, base_tokens = run(engine, requests, arrivals, None)
        if budget is None:
            decode_only = [ms for ms, prefill in base_steps if not prefill]
            budget = args.factor * statistics.median(decode_only)
        steps, wall, tokens = run(engine, requests, arrivals, budget)
        same = same and tokens == base_tokens
        for name, st, w in (("no budget", base_steps, base_wall), (f"budget {budget:.1f} ms", steps, wall)):
            ms = [s for s, _ in st]
            print(f"| {i + 1} | {name} | {len(ms)} | {percentile(ms, 50):.1f} | {percentile(ms, 99):.1f} | "
                  f"{max(ms):.1f} | {gen / w:.1f} |")
        p99 = percentile([s for s, _ in steps], 99)
        pairs.append((p99 / budget, base_wall / wall, percentile([s for s, _ in base_steps], 99)))
    p99s, ratios = [p for p, _, _ in pairs], [r for _, r, _ in pairs]
    print(f"median decode-only step (no budget, first run) {budget / args.factor:.1f} ms; budget {budget:.1f} ms")
    print(f"p99 / budget per pair {', '.join(f'{p:.2f}' for p in p99s)}, median {statistics.median(p99s):.2f} "
          f"(target <= 1.10); throughput of unbudgeted per pair {', '.join(f'{r:.2f}' for r in ratios)}, median "
          f"{statistics.median(ratios):.2f} (target >= 0.85); unbudgeted p99 median "
          f"{statistics.median([b for _, _, b in pairs]):.1f} ms; outputs identical: {same}")
    print(f"cost model after the runs: {engine.step_cost_model()}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
