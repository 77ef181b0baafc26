"""Micro-benchmark of pyengine's CPU GEMM (pyengine.layers.linear.gemm_f32 / gemm_bf16) against
torch's fp32 GEMM (F.linear; for bf16, F.linear on the values converted to fp32, the path a CPU
without bf16 instructions takes) on the linear layers of smollm-135m-shape, at prefill and
decode-batch row counts. Alternating, best of 5 timed loops each (twice); GFLOP/s and the ratio.
With --from-memory each call takes the next of enough copies of the weight to fill 256 MB, so the
weights come from DRAM as in a model's forward (a 30-layer model's decode batch), not from cache.
With --against-decode-kernels the reference is pyengine's decode kernels (linear_f32 /
linear_bf16, at most 64 rows) instead of torch: where the GEMM takes over from them
(GEMM_MIN_ROWS in pyengine/layers/linear.py).

    python bench/gemm.py [--quick] [--dtype float32|bfloat16] [--rows 17,64,512] [--from-memory]
    python bench/gemm.py --against-decode-kernels --from-memory --rows 8,12,13,16,24,64

`PYENGINE_CPU_ISA=avx2` measures the AVX2 build on an AVX-512 machine.
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

from bench.common import BENCH_THREADS, SMOLLM_LAYER_SHAPES, machine_info, set_threads  # noqa: E402

SHAPES = SMOLLM_LAYER_SHAPES  # name -> (N, K)


def best_time(fn: Callable[[], object], flops: float) -> float:
    """Seconds per call: the best of 5 loops of about 50 ms each."""
    fn()
    reps = max(2, int(0.05 / max(flops / 300e9, 1e-6)))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main(argv: list[str] | None = None) -> None:
    from pyengine import cpu_info
    from pyengine.layers.linear import MAX_ROWS, gemm_bf16, gemm_f32, linear_bf16, linear_f32

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="rows 17, 64 and 512 only")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default=None, help="comma-separated row counts (default 17,32,64,128,512,2048)")
    p.add_argument("--from-memory", action="store_true",
                   help="cycle through 256 MB of weight copies (weights read from DRAM, not cache)")
    p.add_argument("--against-decode-kernels", action="store_true",
                   help="compare with linear_f32 / linear_bf16 instead of torch (rows <= 64)")
    args = p.parse_args(argv)
    set_threads()
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")] if args.rows else \
        ([17, 64, 512] if args.quick else [17, 32, 64, 128, 512, 2048])
    ours_fn = gemm_f32 if dtype == torch.float32 else gemm_bf16
    kernel_fn = linear_f32 if dtype == torch.float32 else linear_bf16
    if args.against_decode_kernels and max(rows) > MAX_ROWS:
        p.error(f"--against-decode-kernels: the decode kernels take at most {MAX_ROWS} rows, got {max(rows)}")
    info = machine_info()
    where = "weights from DRAM" if args.from_memory else "weights in cache"
    ref = "pyengine's decode kernel" if args.against_decode_kernels else "torch's fp32 GEMM"
    print(f"pyengine GEMM ({cpu_info().isa}) vs {ref}, {args.dtype}, {where}, {BENCH_THREADS} threads, "
          f"{info['cpu']}, torch {info['torch']}")
    ref_col = "decode kernel" if args.against_decode_kernels else "torch"
    print(f"| rows | layer | N x K | pyengine GEMM GFLOP/s | {ref_col} GFLOP/s | ratio |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for m in rows:
        for name, (n, k) in SHAPES.items():
            x = torch.randn(m, k, generator=g).to(dtype)
            w0 = torch.randn(n, k, generator=g).to(dtype)
            copies = max(2, (256 << 20) // (w0.numel() * w0.element_size())) if args.from_memory else 1
            weights = [w0] + [w0.clone() for _ in range(copies - 1)]
            nxt = [0]

            def weight() -> torch.Tensor:
                nxt[0] = (nxt[0] + 1) % copies
                return weights[nxt[0]]
            out = torch.empty(m, n, dtype=dtype)
            flops = 2.0 * m * n * k
            if args.against_decode_kernels:
                def theirs():
                    return kernel_fn(x, weight(), out=out)
            elif dtype == torch.float32:
                def theirs():
                    return F.linear(x, weight())
            else:
                def theirs():
                    return F.linear(x.float(), weight().float()).to(torch.bfloat16)
            t_ours, t_theirs = [], []
            for _ in range(2):  # alternating
                t_ours.append(best_time(lambda: ours_fn(x, weight(), out=out), flops))
                t_theirs.append(best_time(theirs, flops))
            a, b = min(t_ours), min(t_theirs)
            print(f"| {m} | {name} | {n} x {k} | {flops / a / 1e9:.0f} | {flops / b / 1e9:.0f} | {b / a:.2f}x |")


if __name__ == "__main__":
    main()
