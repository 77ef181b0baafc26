"""Where the weights live, and how fast batch-1 decode streams them: the same bf16 weights read
from the checkpoint file's memory mapping (4 KiB page-cache pages), from a plain copy (4 KiB
anonymous pages) and from the engine's weight region (pyengine/runtime/weight_arena.py: 2 MiB
huge pages where the kernel grants them).

Two measurements, alternating between the placements round by round, medians:
  1. the bf16 linear kernel at M=1 over one large weight (the tied head of the model, 311 MB
     for qwen3-0.6b-shape), in GB/s of weights read;
  2. W2 with the engine: batch-1 decode tok/s with huge_page_weights=True and False.

    python bench/weight_pages.py [--model qwen3-0.6b-shape] [--runs 5] [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (BENCH_THREADS, bench_checkpoint, dram_read_bandwidth, huge_page_copies, machine_info,  # noqa: E402
                          median, set_threads, w2_request)
from bench.latency import pyengine_run  # noqa: E402


def gemv_seconds(w: torch.Tensor, calls: int = 20) -> float:
    """Median seconds of the bf16 kernel's y = x W^T at M=1 over `w` (each call streams all of
    it: far larger than the caches)."""
    from pyengine.layers.linear import linear_bf16

    x = torch.randn(1, w.shape[1]).bfloat16()
    linear_bf16(x, w)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        linear_bf16(x, w)
        times.append(time.perf_counter() - t0)
    return median(times)


def head_placements(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's largest weight (the embedding, which a tied head is) in the three places."""
    from pyengine.models.loader import load_tensors

    name = "model.embed_tokens.weight"
    mapped = load_tensors(model_dir, [name], torch.bfloat16, ())[name]
    return {"file mapping": mapped, "copy, 4 KiB pages": mapped.clone(),
            "weight region": huge_page_copies(mapped, 1)[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="the engine's dtype in measurement 2 (the kernel of 1 is bf16)")
    p.add_argument("--runs", type=int, default=5, help="rounds, alternating the placements")
    p.add_argument("--quick", action="store_true", help="one round")
    args = p.parse_args(argv)
    if args.quick:
        args.runs = 1
    set_threads(BENCH_THREADS)
    from pyengine import Engine, KvCacheConfig, SchedulerConfig

    model_dir = bench_checkpoint(args.model)
    print(f"weight placement — {args.model}, {machine_info()['cpu']}; DRAM read {dram_read_bandwidth() / 1e9:.1f} GB/s "
          "(common.dram_read_bandwidth)")

    heads = head_placements(model_dir)
    nbytes = next(iter(heads.values())).nbytes
    rates: dict[str, list[float]] = {k: [] for k in heads}
    for _ in range(args.runs):
        for k, w in heads.items():
            rates[k].append(nbytes / gemv_seconds(w) / 1e9)
    print(f"\n1. bf16 linear kernel, M=1, over the embedding/head [{', '.join(map(str, next(iter(heads.values())).shape))}]"
          f" ({nbytes / 1e6:.0f} MB), median of {args.runs} rounds of 20 calls")
    print("| weights in | GB/s |\n|---|---|")
    for k, r in rates.items():
        print(f"| {k} | {median(r):.1f} |")
    del heads

    req = w2_request()
    decode: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.runs):
        for huge in (True, False):
            engine = Engine(model_dir, dtype=args.dtype, max_seq_len=512, huge_page_weights=huge,
                            kv_cache_config=KvCacheConfig(max_tokens=2048, enable_block_reuse=False),
                            scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=512))
            pyengine_run(engine, req)  # warm-up
            decode[huge].append(pyengine_run(engine, req)[1])
            engine.shutdown()
            del engine
    on, off = median(decode[True]), median(decode[False])
    print(f"\n2. W2 batch-1 decode, {args.dtype}, median of {args.runs} engines each")
    print("| huge_page_weights | decode tok/s |\n|---|---|")
    print(f"| True (default) | {on:.1f} |\n| False | {off:.1f} |")
    print(f"True/False {on / off:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
