"""W4 — shared prefix: time to first token with prefix reuse on and off.

32 requests sharing a 1,024-token system prompt, each with a distinct 32-token suffix and
64 generated tokens (greedy, EOS ignored), all submitted at once, on the smollm-135m-shape
model (defined in bench/README.md). Reports TTFT median and p90 and the total time for
reuse on and off, run alternately, medians over --runs, and the ratios (on / off).

    python bench/shared_prefix.py            # fp32, 3 runs
    python bench/shared_prefix.py --quick    # 8 requests, 256-token prefix, 16 tokens
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (BENCH_THREADS, machine_info, median, pyengine_bench_args, set_threads,  # noqa: E402
                          smollm_checkpoint, w4_requests)


def run_once(model_dir: Path, dtype: str, requests, reuse: bool) -> dict[str, float]:
    from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

    total_tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    engine = Engine(model_dir, dtype=dtype, max_seq_len=2048,
                    kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=max(total_tokens, 2048),
                                                  enable_block_reuse=reuse),
                    scheduler_config=SchedulerConfig(max_batch_size=len(requests), max_num_tokens=2048))
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outs = engine.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    total = time.perf_counter() - t0
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    reused = sum(o.metrics.num_reused_tokens for o in outs)
    engine.shutdown()
    return {"ttft_median": statistics.median(ttft), "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
            "total": total, "reused_tokens": reused, "tokens": [o.token_ids for o in outs]}


def main(argv: list[str] | None = None) -> int:
    args = pyengine_bench_args(__doc__, argv)
    set_threads(BENCH_THREADS)
    if args.quick:
        requests = w4_requests(num_requests=8, shared_len=256, suffix_len=32, output_len=16)
    else:
        requests = w4_requests()
    model_dir = smollm_checkpoint()
    info = machine_info()
    print(f"W4 shared prefix — {len(requests)} requests, {len(requests[0].prompt_token_ids)}-token prompts "
          f"sharing {len(requests[0].prompt_token_ids) - 32} tokens, {requests[0].max_tokens} generated; "
          f"{args.dtype}; {info['cpu']}, {info['date']}")
    results: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(args.runs):
        for reuse in (False, True):
            r = run_once(model_dir, args.dtype, requests, reuse)
            results[reuse].append(r)
            print(f"  run {i + 1}: reuse {'on ' if reuse else 'off'} TTFT median {r['ttft_median']:.3f} s, "
                  f"p90 {r['ttft_p90']:.3f} s, total {r['total']:.2f} s, reused tokens {r['reused_tokens']}",
                  flush=True)
    same = all(a["tokens"] == b["tokens"] for a, b in zip(results[True], results[False]))
    print(f"  outputs identical with reuse on and off: {same}")
    print("\n| reuse | TTFT median (s) | TTFT p90 (s) | total (s) |\n|---|---|---|---|")
    for reuse in (False, True):
        rs = results[reuse]
        print(f"| {'on' if reuse else 'off'} | {median([r['ttft_median'] for r in rs]):.3f} | "
              f"{median([r['ttft_p90'] for r in rs]):.3f} | {median([r['total'] for r in rs]):.2f} |")
    on, off = results[True], results[False]
    print(f"ratios on/off: TTFT median {median([r['ttft_median'] for r in on]) / median([r['ttft_median'] for r in off]):.2f}x, "
          f"p90 {median([r['ttft_p90'] for r in on]) / median([r['ttft_p90'] for r in off]):.2f}x, "
          f"total {median([r['total'] for r in on]) / median([r['total'] for r in off]):.2f}x")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
