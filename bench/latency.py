"""W2 — single stream: one request, a 128-token prompt, 128 generated tokens, greedy.

Reports pyengine's time to first token and decode tokens/s (after the first token) against
Hugging Face transformers' generate on the same request, and the decode rate against the
memory-bandwidth bound (measured DRAM read bandwidth / parameter bytes: at batch 1 every
token reads every weight once). Medians of --runs. The bandwidth is measured before and after
each pyengine run, and each run's share of the bound uses the mean of those two (on a shared
machine it drifts by tens of percent within minutes); the bound shown is their median.

    python bench/latency.py --dtype float32
    python bench/latency.py --quick               # one timed run
    python bench/latency.py --emulate-cpu avx2    # both sides as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (BENCH_THREADS, DTYPES, add_emulate_cpu_option, dram_read_bandwidth,  # noqa: E402
                          emulate_cpu_level, hf_load, machine_info, median, param_bytes, quiet_transformers,
                          set_threads, smollm_checkpoint, w2_request)


def pyengine_run(engine, req, on_first_token: Callable[[], Any] | None = None) -> tuple[float, float]:
    """(time to first token, decode tok/s after it) of one greedy request run to max_tokens;
    `on_first_token`: called when the first token arrives (e.g. to reset timers of the decode)."""
    from pyengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    for out in engine.stream(req.prompt_token_ids, params):
        if first is None:
            first = time.perf_counter()
            if on_first_token is not None:
                on_first_token()
    end = time.perf_counter()
    return first - t0, (req.max_tokens - 1) / (end - first)


def hf_run(model, req) -> tuple[float, float]:
    from transformers import GenerationConfig

    ids = torch.tensor([req.prompt_token_ids])
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, generation_config=cfg)
        return time.perf_counter() - t0

    ttft = gen(1)
    total = gen(req.max_tokens)
    return ttft, (req.max_tokens - 1) / (total - ttft)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one timed run (after the warm-up) instead of --runs")
    add_emulate_cpu_option(p)
    args = p.parse_args(argv)
    emulate_cpu_level(args.emulate_cpu)
    if args.quick:
        args.runs = 1
    set_threads(BENCH_THREADS)
    quiet_transformers()
    from pyengine import Engine, KvCacheConfig, SchedulerConfig

    model_dir = smollm_checkpoint()
    req = w2_request()
    dtype = DTYPES[args.dtype]
    weights = param_bytes(model_dir, dtype)
    engine = Engine(model_dir, dtype=args.dtype, max_seq_len=512,
                    kv_cache_config=KvCacheConfig(max_tokens=2048, enable_block_reuse=False),
                    scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=512))
    model = hf_load(model_dir, dtype)
    pyengine_run(engine, req), hf_run(model, req)  # warm-up
    pe, hf, bounds = [], [], []
    before = dram_read_bandwidth()
    for _ in range(args.runs):
        pe.append(pyengine_run(engine, req))
        after = dram_read_bandwidth()
        bounds.append((before + after) / 2 / weights)
        hf.append(hf_run(model, req))
        before = dram_read_bandwidth()
    pe_ttft, pe_rate = median([x[0] for x in pe]), median([x[1] for x in pe])
    hf_ttft, hf_rate = median([x[0] for x in hf]), median([x[1] for x in hf])
    bound = median(bounds)
    bandwidth = bound * weights
    pe_share = median([x[1] / b for x, b in zip(pe, bounds)])
    info = machine_info()
    cpu = info["cpu"] + (f" as an {info['emulated_cpu_level']} CPU" if info["emulated_cpu_level"] else "")
    print(f"W2 single stream — {args.dtype}, {cpu}; DRAM read {bandwidth / 1e9:.1f} GB/s "
          f"(median; per run {', '.join(f'{b * weights / 1e9:.1f}' for b in bounds)}), weights {weights / 1e6:.0f} MB "
          f"-> bound {bound:.1f} tok/s")
    print("| | TTFT (ms) | decode tok/s | decode vs bandwidth bound |\n|---|---|---|---|")
    print(f"| pyengine | {pe_ttft * 1e3:.1f} | {pe_rate:.1f} | {pe_share:.0%} |")
    print(f"| transformers | {hf_ttft * 1e3:.1f} | {hf_rate:.1f} | {hf_rate / bound:.0%} |")
    print(f"TTFT pyengine/transformers {pe_ttft / hf_ttft:.2f}x; decode pyengine/transformers {pe_rate / hf_rate:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
