"""W1 with the overlap loop on and off (pyengine only), alternating runs, medians.

    python bench/overlap.py --quick
    python bench/overlap.py --runs 3
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (BENCH_THREADS, machine_info, median, pyengine_bench_args, set_threads,  # noqa: E402
                          smollm_checkpoint, w1_engine, w1_workload)


def main(argv: list[str] | None = None) -> int:
    args = pyengine_bench_args(__doc__, argv)
    set_threads(BENCH_THREADS)
    from pyengine import SamplingParams

    wl = w1_workload(quick=args.quick)
    model_dir = smollm_checkpoint()
    engines = {ov: w1_engine(model_dir, args.dtype, wl.requests, overlap=ov) for ov in (False, True)}
    prompts = [r.prompt_token_ids for r in wl.requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in wl.requests]
    print(f"Overlap — {wl.name} ({len(prompts)} requests, {wl.generated_tokens} generated tokens), {args.dtype}, "
          f"{machine_info()['cpu']}")
    times: dict[bool, list[float]] = {False: [], True: []}
    outputs: dict[bool, list] = {}
    for engine in engines.values():  # warm-up
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for i in range(args.runs):
        for ov, engine in engines.items():
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params, use_tqdm=False)
            times[ov].append(time.perf_counter() - t0)
            outputs[ov] = [o.token_ids for o in outs]
            print(f"  run {i + 1}: overlap {'on ' if ov else 'off'} {times[ov][-1]:.2f} s", flush=True)
    off, on = median(times[False]), median(times[True])
    print(f"\n| overlap | time (s) | generated tok/s |\n|---|---|---|\n| off | {off:.2f} | "
          f"{wl.generated_tokens / off:.1f} |\n| on | {on:.2f} | {wl.generated_tokens / on:.1f} |")
    print(f"ratio on/off (throughput): {off / on:.3f}x; outputs identical: {outputs[True] == outputs[False]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
