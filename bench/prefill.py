"""Prefill: prompt tokens/s for one 2,047-token prompt in one chunk, against what the
layer's matrix multiplies alone reach with torch.mm in the same dtype (the machine's
practical peak for this work). Ratio = matmul-only time / pyengine's prefill time.

    python bench/prefill.py --dtype float32
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (BENCH_THREADS, DTYPES, layer_linear_shapes, machine_info, median,  # noqa: E402
                          pyengine_bench_args, set_threads, smollm_checkpoint)

TOKENS = 2047  # + 1 generated token = max_position_embeddings


def matmul_only_seconds(cfg: dict, dtype: torch.dtype, tokens: int, runs: int) -> tuple[float, float]:
    """Seconds for the prefill's matrix multiplies alone (all layers + one lm_head row), and their GFLOP."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    linears = layer_linear_shapes(h, cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"])
    shapes = [(tokens, k, n) for n, k in linears.values()]
    mats = [(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)) for m, k, n in shapes]
    head = (torch.randn(1, h, dtype=dtype), torch.randn(h, v, dtype=dtype))
    flops = cfg["num_hidden_layers"] * sum(2 * m * k * n for m, k, n in shapes) + 2 * h * v

    def once() -> float:
        t0 = time.perf_counter()
        for _ in range(cfg["num_hidden_layers"]):
            for a, b in mats:
                torch.mm(a, b)
        torch.mm(*head)
        return time.perf_counter() - t0

    once()
    return median([once() for _ in range(runs)]), flops / 1e9


def main(argv: list[str] | None = None) -> int:
    args = pyengine_bench_args(__doc__, argv)
    set_threads(BENCH_THREADS)
    import json

    from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

    model_dir = smollm_checkpoint()
    cfg = json.loads((model_dir / "config.json").read_text())
    engine = Engine(model_dir, dtype=args.dtype, max_seq_len=TOKENS + 1,
                    kv_cache_config=KvCacheConfig(max_tokens=4 * TOKENS, enable_block_reuse=False),
                    scheduler_config=SchedulerConfig(max_batch_size=1, max_num_tokens=2048))
    prompt = [(17 * j) % cfg["vocab_size"] for j in range(TOKENS)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill() -> float:
        t0 = time.perf_counter()
        engine.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0

    prefill()
    engine_s = median([prefill() for _ in range(args.runs)])
    mm_s, gflop = matmul_only_seconds(cfg, DTYPES[args.dtype], TOKENS, args.runs)
    print(f"Prefill of {TOKENS} tokens in one chunk — {args.dtype}, {machine_info()['cpu']}")
    print(f"  pyengine: {engine_s:.3f} s = {TOKENS / engine_s:.0f} prompt tok/s")
    print(f"  the matrix multiplies alone (torch.mm, same shapes): {mm_s:.3f} s, {gflop / mm_s:.0f} GFLOP/s")
    print(f"  pyengine reaches {mm_s / engine_s:.0%} of the matmul-only rate (target >= 50%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
