"""Micro-benchmark of the GPU's weight-only quantized linear layer (QuantizedWeight on CUDA,
csrc/kernels/cuda/linear_quant.cu); needs a GPU.

The linear layers of one Qwen3-0.6B decoder layer (qkv 4096 x 1024, o 1024 x 2048, gate_up
6144 x 1024, down 1024 x 3072) and its tied output projection (151936 x 1024), per format
(q8_0, q4_0, q4_k, q6_k, q4_z) and row count M (1, 8, 64) with bf16 activations: time per call
(CUDA-event median after warm-up), the weights' bytes over that time as achieved bandwidth,
and that as a fraction of the device-to-device copy bandwidth measured in the same run, next to
torch's bf16 matmul of the same shapes (the dense weights' bytes).

Usage: python bench/quant_linear_cuda.py [--iters N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pyengine.quant import QuantizedWeight

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
FORMATS = ("q8_0", "q4_0", "q4_k", "q6_k", "q4_z")


def cuda_time(fn, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(iters: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src), iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    bw = copy_bandwidth(args.iters)
    print(f"{torch.cuda.get_device_name()}: device copy {bw / 1e9:.0f} GB/s")
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        dense = w.to("cuda", torch.bfloat16)
        for m in (1, 8, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = cuda_time(lambda: x @ dense.T, args.iters)
            rows.append(dict(shape=name, n=n, k=k, m=m, format="bf16 (torch)", us=t * 1e6,
                             gbs=dense.numel() * 2 / t / 1e9))
            for fmt in FORMATS:
                q = QuantizedWeight.quantize(w, fmt).to("cuda")
                t = cuda_time(lambda: q.linear(x), args.iters)
                rows.append(dict(shape=name, n=n, k=k, m=m, format=fmt, us=t * 1e6, gbs=q.nbytes / t / 1e9))
    print("| shape | M | format | us | weight GB/s | of copy bw |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['m']} | {r['format']} | {r['us']:.1f} | {r['gbs']:.0f} | "
              f"{r['gbs'] * 1e9 / bw:.0%} |")
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy_bw=bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
