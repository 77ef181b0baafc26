"""Micro-benchmark of the CPU bf16 linear kernel (pyengine.layers.linear.linear_bf16) on the
linear layers of the W2 model (smollm-135m-shape) at M=1 (batch-1 decode).

Reports the weight-read bandwidth each achieves (weight bytes / time) for: the kernel, torch
bf16 F.linear, and torch fp32 F.linear on fp32 weights (twice the bytes), next to the idle DRAM
read bandwidth (sum over a 512 MB tensor) measured in the same run. Several copies of each
weight are cycled so that every call reads from DRAM, not from cache (the L3 can be large).
Medians of --iters calls.

    python bench/linear_bf16.py [--quick] [--rows M] [--iters N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import BENCH_THREADS, dram_read_bandwidth, SMOLLM_LAYER_SHAPES, machine_info, set_threads  # noqa: E402

# smollm-135m-shape's layers, and an lm_head of 32,000 rows: name -> (N, K)
SHAPES: dict[str, tuple[int, int]] = {**SMOLLM_LAYER_SHAPES, "lm_head": (32000, SMOLLM_LAYER_SHAPES["o"][0])}
# Bytes of weight copies cycled per shape (far beyond L2; the L3 is shared and may be larger).
CYCLE_BYTES = 768 * 2**20


def time_cycled(fn: Callable[[torch.Tensor], object], weights: list[torch.Tensor], iters: int) -> float:
    """Median seconds of fn(w) over `iters` calls, w cycling through `weights`."""
    for w in weights[:3]:
        fn(w)
    times = []
    for i in range(iters):
        w = weights[i % len(weights)]
        t0 = time.perf_counter()
        fn(w)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer calls per measurement")
    p.add_argument("--rows", type=int, default=1, help="rows of x (M)")
    p.add_argument("--iters", type=int, default=0, help="calls per measurement (0: 200, quick 50)")
    args = p.parse_args(argv)
    set_threads(BENCH_THREADS)
    from pyengine.layers.linear import linear_bf16
    from pyengine.layers.cpu_features import cpu_info

    iters = args.iters or (50 if args.quick else 200)
    bandwidth = dram_read_bandwidth()
    print(f"linear_bf16 ({cpu_info().isa}), M={args.rows}, {BENCH_THREADS} threads, {machine_info()['cpu']}; "
          f"idle DRAM read {bandwidth / 1e9:.1f} GB/s")
    print("| layer | N x K | kernel GB/s | torch bf16 GB/s | torch fp32 GB/s | kernel vs DRAM | kernel / torch bf16 |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(2, CYCLE_BYTES // (n * k * 4))  # sized for fp32; bf16 uses the same count
        w16 = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for _ in range(copies)]
        x16 = torch.randn(args.rows, k, generator=gen).to(torch.bfloat16)
        out = torch.empty(args.rows, n, dtype=torch.bfloat16)
        t_kernel = time_cycled(lambda w: linear_bf16(x16, w, out=out), w16, iters)
        t_bf16 = time_cycled(lambda w: F.linear(x16, w), w16, max(10, iters // 4))
        del w16
        w32 = [torch.randn(n, k, generator=gen) for _ in range(copies)]
        x32 = x16.float()
        t_fp32 = time_cycled(lambda w: F.linear(x32, w), w32, iters)
        del w32
        b16, b32 = n * k * 2, n * k * 4
        print(f"| {name} | {n} x {k} | {b16 / t_kernel / 1e9:.1f} | {b16 / t_bf16 / 1e9:.1f} | "
              f"{b32 / t_fp32 / 1e9:.1f} | {b16 / t_kernel / bandwidth:.0%} | {t_bf16 / t_kernel:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
