"""The sampler's share of step time on W1: greedy against temperature=0.8, top_p=0.9.

Runs W1 (or --quick's smaller W1) on pyengine twice per run — greedy, then sampling — and
reports, from Engine.timings(), the seconds spent in schedule / forward / sample / update
and the sampler's share of the step, medians over --runs.

    python bench/sampler_share.py --quick
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (BENCH_THREADS, machine_info, median, pyengine_bench_args, set_threads,  # noqa: E402
                          smollm_checkpoint, w1_engine, w1_workload)

PARTS = ("schedule", "forward", "sample", "update")


def main(argv: list[str] | None = None) -> int:
    args = pyengine_bench_args(__doc__, argv)
    set_threads(BENCH_THREADS)
    from pyengine import SamplingParams

    wl = w1_workload(quick=args.quick)
    engine = w1_engine(smollm_checkpoint(), args.dtype, wl.requests)
    modes = {
        "greedy": dict(temperature=0.0),
        "T=0.8,top_p=0.9": dict(temperature=0.8, top_p=0.9, seed=0),
    }
    print(f"Sampler share — {wl.name}, {args.dtype}, {machine_info()['cpu']}")
    shares: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.runs):
        for mode, kw in modes.items():
            params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **kw) for r in wl.requests]
            engine.reset_timings()
            engine.generate([r.prompt_token_ids for r in wl.requests], params, use_tqdm=False)
            shares[mode].append(engine.timings())
    print("\n| mode | schedule (s) | forward (s) | sample (s) | update (s) | sample share of step |")
    print("|---|---|---|---|---|---|")
    for mode, runs in shares.items():
        med = {k: median([r[k] for r in runs]) for k in PARTS}
        share = med["sample"] / sum(med.values())
        print(f"| {mode} | {med['schedule']:.3f} | {med['forward']:.3f} | {med['sample']:.4f} | "
              f"{med['update']:.3f} | {100 * share:.2f}% |")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
