"""Micro-benchmark of the GPU's weight-only quantized linear layer (QuantizedWeight on CUDA,
csrc/kernels/cuda/linear_quant.cu); needs a GPU.

The linear layers of one Qwen3-0.6B decoder layer (qkv 4096 x 1024, o 1024 x 2048, gate_up
6144 x 1024, down 1024 x 3072) and its tied output projection (151936 x 1024), per format
(q8_0, q4_0, q4_k, q6_k, q4_z) and row count M with bf16 activations, through both paths
QuantizedWeight.linear chooses between -- the GEMV kernel ("gemv", the default up to
CUDA_GEMV_MAX_ROWS rows) and the weights dequantized into torch's GEMM ("dequant+mm", beyond) --
next to torch's bf16 matmul of the same shapes. Each figure is the CUDA-event median of replays
of a CUDA graph of 10 calls (no launch overhead), cycling through copies of the weights that
together exceed the L2 cache (device memory, not cache); the weights' bytes over that time are
the achieved bandwidth, also as a fraction of the device-to-device copy bandwidth measured in
the same run.

Usage: python bench/quant_linear_cuda.py [--iters N] [--quick] [--rows 1,2,4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import pyengine.quant.weight as quant_weight
from pyengine.quant import QuantizedWeight

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k", "q4_z")
CALLS_PER_GRAPH = 10
ROTATE_BYTES = 256 << 20  # > the H200's 60 MB of L2


def cuda_time(fn, iters: int, warmup: int = 3) -> float:
    """Seconds per call of fn: a graph of CALLS_PER_GRAPH calls, replayed; the median replay."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / CALLS_PER_GRAPH)
    return sorted(times)[len(times) // 2]


def rotating(items: list):
    """A function returning the items in turn (each call of a captured graph takes the next)."""
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(items)
        return items[state["i"]]
    return nxt


def copy_bandwidth(iters: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="q8_0 and q4_k, M 1 / 8 / 64")
    p.add_argument("--rows", default=None, help="the row counts M, comma-separated (default 1,2,4,8,16,64)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    formats = ("q8_0", "q4_k") if args.quick else FORMATS
    ms = (1, 8, 64) if args.quick else (1, 2, 4, 8, 16, 64)
    if args.rows:
        ms = tuple(int(r) for r in args.rows.split(","))
    bw = copy_bandwidth(args.iters)
    print(f"{torch.cuda.get_device_name()}: device copy {bw / 1e9:.0f} GB/s")
    rows = []
    default_max = quant_weight.CUDA_GEMV_MAX_ROWS
    print(f"(QuantizedWeight.linear takes the GEMV kernel up to {default_max} rows)")
    print("| shape | M | format | path | us | weight GB/s | of copy bw |\n|---|---|---|---|---|---|---|", flush=True)

    def add(**r) -> None:  # printed as measured: a run cut short still shows what it measured
        rows.append(r)
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['m']} | {r['format']} | {r['path']} | {r['us']:.1f} | "
              f"{r['gbs']:.0f} | {r['gbs'] * 1e9 / bw:.0%} |", flush=True)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        dense = w.to("cuda", torch.bfloat16)
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / dense.nbytes)))
        denses = rotating([dense] + [dense.clone() for _ in range(copies - 1)])
        quantized = {}
        for fmt in formats:
            q = QuantizedWeight.quantize(w, fmt).to("cuda")
            copies = max(1, min(8, math.ceil(ROTATE_BYTES / q.nbytes)))
            quantized[fmt] = (q.nbytes, rotating([q] + [QuantizedWeight([(f, d.clone()) for f, d in q.parts], k)
                                                        for _ in range(copies - 1)]))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = cuda_time(lambda: x @ denses().T, args.iters)
            add(shape=name, n=n, k=k, m=m, format="bf16 (torch)", path="mm", us=t * 1e6, gbs=dense.nbytes / t / 1e9)
            for fmt, (nbytes, qs) in quantized.items():
                for path, limit in (("gemv", 1 << 30), ("dequant+mm", 0)):
                    if path == "gemv" and m > 16:
                        continue  # (8 rows a pass: 64 rows read the weights 8 times)
                    quant_weight.CUDA_GEMV_MAX_ROWS = limit
                    try:
                        t = cuda_time(lambda: qs().linear(x), args.iters)
                    finally:
                        quant_weight.CUDA_GEMV_MAX_ROWS = default_max
                    add(shape=name, n=n, k=k, m=m, format=fmt, path=path, us=t * 1e6, gbs=nbytes / t / 1e9)
        del quantized, denses
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_bw=bw,
                                             gemv_max_rows=default_max, rows=rows), indent=1))


if __name__ == "__main__":
    main()
