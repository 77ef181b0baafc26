"""W1 — offline mixed batch (throughput): pyengine against Hugging Face transformers.

64 requests from random.Random(0): random-token prompts of 32..512 tokens, 16..256
generated tokens each (EOS ignored), greedy, on the random-weight smollm-135m-shape model
(defined in bench/README.md). Both engines run in the same process, alternating run by run
(reference, pyengine, reference, pyengine, ...) so that machine noise hits both alike; each
figure is the median of --runs runs, and the ratio is pyengine's median over the
reference's.

    python bench/throughput.py                     # fp32 and bf16, 3 runs each (long)
    python bench/throughput.py --quick             # small workload, < 2 minutes
    python bench/throughput.py --dtype float32 --runs 5
    python bench/throughput.py --reference-only    # HF side alone (no compiled engine)
    python bench/throughput.py --emulate-cpu avx2  # both sides as on an AVX2-only CPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    BENCH_THREADS,
    DTYPES,
    EMULATED_CPU_LEVELS,
    Request,
    RunResult,
    Workload,
    add_emulate_cpu_option,
    compare_outputs,
    emulate_cpu_level,
    hf_generate_static,
    hf_load,
    machine_info,
    median,
    quiet_transformers,
    set_threads,
    smollm_checkpoint,
    w1_workload,
)

HF_BATCH_SIZE = 16
TOKENS_PER_BLOCK = 16
WARMUP = [Request(list(range(100, 116)), 4)]


# --------------------------------------------------------------------------------------
# The pyengine side
# --------------------------------------------------------------------------------------


def kv_tokens_needed(
    requests: list[Request], model_dir: Path | None = None, tokens_per_block: int = TOKENS_PER_BLOCK
) -> int:
    """KV capacity (tokens, whole blocks) for all requests resident at once, and at least
    one sequence of the model's max_position_embeddings (the engine's default max_seq_len,
    which its pool must hold)."""
    blocks = sum(
        math.ceil((len(r.prompt_token_ids) + r.max_tokens) / tokens_per_block) for r in requests
    )
    if model_dir is not None:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        blocks = max(blocks, math.ceil(cfg.get("max_position_embeddings", 0) / tokens_per_block))
    return blocks * tokens_per_block


class PyengineRunner:
    """Builds the engine once; ``run`` generates the workload and times it."""

    def __init__(self, model_dir: Path, dtype: str, requests: list[Request], kv_tokens: int,
                 quantization: str | None = None, lm_head_quantization: str | None = None):
        from pyengine import Engine, KvCacheConfig, SchedulerConfig

        self.engine = Engine(
            str(model_dir),
            dtype=dtype,
            quantization=quantization,  # e.g. "q4_k": quantize the weights at load (dtype float32)
            lm_head_quantization=lm_head_quantization,  # with it: the output projection's format
            kv_cache_config=KvCacheConfig(tokens_per_block=TOKENS_PER_BLOCK, max_tokens=kv_tokens,
                                          enable_block_reuse=False),  # runs repeat the prompts
            scheduler_config=SchedulerConfig(
                max_batch_size=64, max_num_tokens=2048, enable_chunked_prefill=True
            ),
        )

    def run(self, requests: list[Request]) -> RunResult:
        from pyengine import SamplingParams

        prompts = [list(r.prompt_token_ids) for r in requests]
        params = [
            SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            for r in requests
        ]
        c0, t0 = time.process_time(), time.perf_counter()
        results = self.engine.generate(prompts, params, use_tqdm=False)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        outputs = [list(res.token_ids) for res in results]
        for i, (r, out) in enumerate(zip(requests, outputs)):
            if len(out) != r.max_tokens:
                raise RuntimeError(
                    f"pyengine generated {len(out)} tokens for request {i}, expected {r.max_tokens}"
                )
        return RunResult(
            seconds,
            sum(len(p) for p in prompts),
            sum(r.max_tokens for r in requests),
            outputs,
            cpu,
        )

    def close(self) -> None:
        self.engine.shutdown()


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def fmt_line(name: str, runs: list[RunResult]) -> str:
    gen = [r.generated_tps for r in runs]
    tot = [r.total_tps for r in runs]
    secs = [r.seconds for r in runs]
    return (
        f"  {name:<10} generated {median(gen):9.1f} tok/s  total {median(tot):9.1f} tok/s  "
        f"time {median(secs):7.2f} s  (runs: {', '.join(f'{s:.2f}' for s in secs)} s)"
    )


def bench_dtype(
    dtype_name: str, model_dir: Path, wl: Workload, args: argparse.Namespace
) -> dict:
    dtype = DTYPES[dtype_name]
    print(f"\n[{dtype_name}] loading the reference model ...", flush=True)
    model = hf_load(model_dir, dtype)
    hf_generate_static(model, WARMUP, HF_BATCH_SIZE)

    engine = None
    if not args.reference_only:
        kv = args.kv_tokens or kv_tokens_needed(wl.requests, model_dir)
        print(f"[{dtype_name}] starting pyengine (KV cache {kv} tokens) ...", flush=True)
        engine = PyengineRunner(model_dir, dtype_name, wl.requests, kv)
        engine.run(WARMUP)

    hf_runs: list[RunResult] = []
    pe_runs: list[RunResult] = []
    try:
        for i in range(args.runs):
            hf_runs.append(hf_generate_static(model, wl.requests, HF_BATCH_SIZE))
            h = hf_runs[-1]
            msg = (
                f"[{dtype_name}] run {i + 1}/{args.runs}: reference {h.seconds:.2f} s "
                f"(cpu {h.cpu_utilization:.0%})"
            )
            if engine is not None:
                pe_runs.append(engine.run(wl.requests))
                e = pe_runs[-1]
                msg += f", pyengine {e.seconds:.2f} s (cpu {e.cpu_utilization:.0%})"
            print(msg, flush=True)
    finally:
        if engine is not None:
            engine.close()
    del model

    starved = [r for r in hf_runs + pe_runs if r.cpu_utilization < 0.9]
    if starved:
        print(
            f"[{dtype_name}] warning: {len(starved)} run(s) got < 90% of {BENCH_THREADS} CPUs "
            "(other processes were running); their times are inflated, the medians may be too"
        )
    print(f"[{dtype_name}] median of {args.runs} runs:")
    print(fmt_line("reference", hf_runs))
    out = {
        "dtype": dtype_name,
        "reference": {
            "generated_tps": median([r.generated_tps for r in hf_runs]),
            "total_tps": median([r.total_tps for r in hf_runs]),
            "seconds": [r.seconds for r in hf_runs],
            "cpu_utilization": [r.cpu_utilization for r in hf_runs],
        },
    }
    if pe_runs:
        print(fmt_line("pyengine", pe_runs))
        g = median([r.generated_tps for r in pe_runs]) / out["reference"]["generated_tps"]
        t = median([r.total_tps for r in pe_runs]) / out["reference"]["total_tps"]
        agree = compare_outputs(pe_runs[0].outputs, hf_runs[0].outputs)
        print(f"  ratio pyengine/reference: generated {g:.2f}x  total {t:.2f}x")
        print(
            f"  greedy agreement with the reference (informational): "
            f"{agree['identical']:.0%} of requests identical, "
            f"{agree['common_prefix']:.0%} of tokens before the first difference"
        )
        out["pyengine"] = {
            "generated_tps": median([r.generated_tps for r in pe_runs]),
            "total_tps": median([r.total_tps for r in pe_runs]),
            "seconds": [r.seconds for r in pe_runs],
            "cpu_utilization": [r.cpu_utilization for r in pe_runs],
        }
        out["ratio_generated"], out["ratio_total"] = g, t
        out["agreement"] = agree
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (median; default 3)")
    p.add_argument("--quick", action="store_true", help="small workload, finishes in < 2 minutes")
    p.add_argument("--reference-only", action="store_true", help="run the HF reference alone")
    p.add_argument("--kv-tokens", type=int, default=None, help="pyengine KV cache max_tokens")
    p.add_argument("--checkpoint-root", type=Path, default=None, help="checkpoint cache dir")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    add_emulate_cpu_option(p)
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be >= 1, got {args.runs}")
    emulate_cpu_level(args.emulate_cpu)

    set_threads(BENCH_THREADS)
    quiet_transformers()
    if not args.reference_only:
        try:
            import pyengine  # noqa: F401
            from pyengine import Engine  # noqa: F401
        except ImportError as e:
            print(
                f"error: cannot import the pyengine engine ({e}); build it, or run with "
                "--reference-only",
                file=sys.stderr,
            )
            return 2

    info = machine_info()
    wl = w1_workload(quick=args.quick)
    t0 = time.perf_counter()
    model_dir = smollm_checkpoint(args.checkpoint_root)
    print(f"W1 throughput — {wl.name}")
    print(
        f"  machine: {info['cpu']}, {info['logical_cpus']} CPUs, torch threads "
        f"{info['torch_threads']}, load {info['loadavg_1m']}, {info['date']}"
    )
    level = info["emulated_cpu_level"]
    if level:
        print(f"  as an {level} CPU: " + " ".join(f"{k}={v}" for k, v in EMULATED_CPU_LEVELS[level].items()))
    print(f"  torch {info['torch']}, transformers {info['transformers']}")
    print(f"  model: smollm-135m-shape at {model_dir} (ready in {time.perf_counter() - t0:.1f} s)")
    print(
        f"  workload: {len(wl.requests)} requests, {wl.prompt_tokens} prompt tokens, "
        f"{wl.generated_tokens} generated tokens; reference in static batches of "
        f"{HF_BATCH_SIZE}, left-padded"
    )
    if wl.note:
        print(f"  {wl.note}")
    if args.reference_only:
        print("  reference only: pyengine not run")

    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    results = [bench_dtype(d, model_dir, wl, args) for d in dtypes]

    print("\nSummary (median tok/s; generated / total):")
    print("| dtype | reference | pyengine | ratio |")
    print("|---|---|---|---|")
    for r in results:
        ref = f"{r['reference']['generated_tps']:.1f} / {r['reference']['total_tps']:.1f}"
        if "pyengine" in r:
            pe = f"{r['pyengine']['generated_tps']:.1f} / {r['pyengine']['total_tps']:.1f}"
            ratio = f"{r['ratio_generated']:.2f}x / {r['ratio_total']:.2f}x"
        else:
            pe, ratio = "not run", "-"
        print(f"| {r['dtype']} | {ref} | {pe} | {ratio} |")
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")

    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "workload": wl.name,
                    "note": wl.note,
                    "machine": info,
                    "runs": args.runs,
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
