"""Micro-benchmark of the CPU quantized linear kernel (QuantizedWeight.linear, the interleaved
layouts the model uses) on the linear layers of qwen3-0.6b-shape (the W5 model) at M=1
(batch-1 decode), per format, next to pyengine's own bf16 and fp32 kernels on the same shapes.

Reports, per layer and format, the weight-read bandwidth (weight bytes / time) and the time
against the bf16 kernel's on the same shape: what the bytes saved buy at batch 1 (a format
that streams as fast as bf16 gives 2 / (bytes per weight) times its speed: Q8_0 1.88x, Q4_0
and Q4_K 3.56x). Every weight lies in huge pages, as a model's do (`huge_page_weights`). The
idle DRAM read bandwidth (a sum over a 512 MB tensor) is measured in the
same run. Several copies of each weight are cycled so that every call reads from DRAM; medians
of --iters calls.

    python bench/linear_quant.py [--quick] [--formats q8_0,q4_0,q4_k] [--iters N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import BENCH_THREADS, dram_read_bandwidth, huge_page_copies, machine_info, set_threads  # noqa: E402
from bench.linear_bf16 import time_cycled  # noqa: E402

# qwen3-0.6b-shape's linear layers (hidden 1024, 16 + 2 x 8 heads of 128, intermediate 3072)
# and its tied output projection: name -> (N, K)
SHAPES: dict[str, tuple[int, int]] = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                                      "down": (1024, 3072), "lm_head": (151936, 1024)}
CYCLE_BYTES = 768 * 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer calls per measurement, no lm_head")
    p.add_argument("--formats", default="q8_0,q4_0,q4_k,q6_k")
    p.add_argument("--iters", type=int, default=0, help="calls per measurement (0: 100, quick 30)")
    args = p.parse_args(argv)
    set_threads(BENCH_THREADS)
    from pyengine.layers.cpu_features import cpu_info
    from pyengine.layers.linear import linear_bf16, linear_f32
    from pyengine.quant import QuantizedWeight

    iters = args.iters or (30 if args.quick else 100)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bandwidth = dram_read_bandwidth()
    info = cpu_info()
    print(f"quantized linear ({info.isa}, {info.vnni or 'no VNNI'}), M=1, {BENCH_THREADS} threads, "
          f"{machine_info()['cpu']}; idle DRAM read {bandwidth / 1e9:.1f} GB/s")
    print("| layer | N x K | format | GB/s | of DRAM | time vs pyengine bf16 |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    shapes = {k: v for k, v in SHAPES.items() if not (args.quick and k == "lm_head")}
    for name, (n, k) in shapes.items():
        base = torch.randn(n, k, generator=gen)
        x = torch.randn(1, k, generator=gen)

        copies = max(2, CYCLE_BYTES // (n * k * 4))
        w32 = huge_page_copies(base, copies)
        t32 = time_cycled(lambda w: linear_f32(x, w), w32, iters)
        del w32
        copies = max(2, CYCLE_BYTES // (n * k * 2))
        w16 = huge_page_copies(base.to(torch.bfloat16), copies)
        x16 = x.to(torch.bfloat16)
        t16 = time_cycled(lambda w: linear_bf16(x16, w), w16, iters)
        del w16
        print(f"| {name} | {n} x {k} | fp32 | {n * k * 4 / t32 / 1e9:.1f} | {n * k * 4 / t32 / bandwidth:.0%} | "
              f"{t32 / t16:.2f} |")
        print(f"| {name} | {n} x {k} | bf16 | {n * k * 2 / t16 / 1e9:.1f} | {n * k * 2 / t16 / bandwidth:.0%} | 1.00 |")
        for fmt in formats:
            q = QuantizedWeight.quantize(base, fmt).interleaved()
            copies = max(2, CYCLE_BYTES // q.nbytes)
            (f, d), = q.parts
            qs = [QuantizedWeight([(f, c)], k) for c in huge_page_copies(d, copies)]
            tq = time_cycled(lambda w: w.linear(x), qs, iters)
            print(f"| {name} | {n} x {k} | {fmt} | {q.nbytes / tq / 1e9:.1f} | {q.nbytes / tq / bandwidth:.0%} | "
                  f"{tq / t16:.2f} ({t16 / tq:.2f}x faster) |", flush=True)
            del qs, q
    return 0


if __name__ == "__main__":
    sys.exit(main())
