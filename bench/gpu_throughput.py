"""W1 on a GPU: pyengine (CUDA graphs on, and off) against Hugging Face transformers'
`generate` in static batches of 16, same GPU, same dtype (bf16), on a random-weight model of
Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate
3072, vocab 151,936). Workload: "W1 on a GPU" in bench/README.md (W1's 64 requests, prompts
32..512, outputs 16..256, greedy, EOS ignored, token ids drawn from the model's vocabulary).

    python bench/gpu_throughput.py            # 3 runs each, median
    python bench/gpu_throughput.py --quick    # W1-quick, 1 run
    python bench/gpu_throughput.py --quantization q4_k   # also with Q4_K weights (weight-only kernels)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (  # noqa: E402
    RunResult, cached_checkpoint, checkpoints, compare_outputs, hf_generate_static, hf_load, median,
    quiet_transformers, w1_workload)


def pyengine_run(engine, requests) -> RunResult:
    from pyengine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    prompts = [list(r.prompt_token_ids) for r in requests]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    outputs = [list(r.token_ids) for r in results]
    return RunResult(seconds, sum(map(len, prompts)), sum(r.max_tokens for r in requests), outputs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--checkpoint-root", type=Path, default=None)
    p.add_argument("--quantization", default=None,
                   help="also run pyengine with the weights quantized at load (q8_0, q4_0, q4_k; weight-only "
                        "kernels, bf16 activations)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    quiet_transformers()
    from pyengine import Engine, KvCacheConfig, SchedulerConfig

    shape = checkpoints.QWEN3_06B_SHAPE
    t0 = time.perf_counter()
    model_dir = cached_checkpoint("qwen3-0.6b-shape", shape, args.checkpoint_root)
    print(f"checkpoint {model_dir} ready in {time.perf_counter() - t0:.1f} s")
    workload = w1_workload(args.quick, vocab_size=shape["vocab_size"])
    requests = workload.requests
    runs = 1 if args.quick else args.runs
    results: dict[str, list[RunResult]] = {}

    hf = hf_load(model_dir, torch.bfloat16).to("cuda")
    hf_generate_static(hf, requests[:2])  # warm-up
    results["transformers"] = [hf_generate_static(hf, requests) for _ in range(runs)]
    del hf
    torch.cuda.empty_cache()

    variants = [("pyengine", True, None), ("pyengine (no graphs)", False, None)]
    if args.quantization:
        variants.append((f"pyengine {args.quantization}", True, args.quantization))
    for name, graphs, quantization in variants:
        t0 = time.perf_counter()
        engine = Engine(model_dir, dtype="bfloat16", device="cuda", cuda_graphs=graphs, max_seq_len=1024,
                        quantization=quantization,
                        kv_cache_config=KvCacheConfig(enable_block_reuse=False),
                        scheduler_config=SchedulerConfig(max_batch_size=64, max_num_tokens=2048))
        report = engine.startup_report()
        phases = ", ".join(f"{ph['name']} {ph['seconds']:.2f}" for ph in report["phases"])
        print(f"{name}: start-up {time.perf_counter() - t0:.1f} s ({phases}), "
              f"KV pool {report['kv_capacity']['num_blocks']} blocks")
        pyengine_run(engine, requests[:4])  # warm-up
        results[name] = [pyengine_run(engine, requests) for _ in range(runs)]
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()

    ref = median([r.generated_tps for r in results["transformers"]])
    print(f"\n{workload.name} on {torch.cuda.get_device_name()} (bf16, {len(requests)} requests, "
          f"{workload.generated_tokens} generated tokens), median of {runs}:")
    print(f"{'engine':<22} {'gen tok/s':>10} {'total tok/s':>12} {'seconds':>9} {'vs HF':>7}")
    summary = {}
    for name, rs in results.items():
        gen = median([r.generated_tps for r in rs])
        tot = median([r.total_tps for r in rs])
        secs = median([r.seconds for r in rs])
        print(f"{name:<22} {gen:>10.1f} {tot:>12.1f} {secs:>9.2f} {gen / ref:>6.2f}x")
        summary[name] = {"generated_tps": gen, "total_tps": tot, "seconds": secs, "ratio": gen / ref}
    agree = compare_outputs(results["pyengine"][0].outputs, results["transformers"][0].outputs)
    same = compare_outputs(results["pyengine"][0].outputs, results["pyengine (no graphs)"][0].outputs)
    print(f"greedy agreement with transformers (bf16, informational): {agree}")
    print(f"graphs on vs off, identical requests: {same}")
    if args.quantization:  # (other weights: agreement says how far the quantization moves greedy outputs)
        quant = compare_outputs(results[f"pyengine {args.quantization}"][0].outputs, results["pyengine"][0].outputs)
        print(f"{args.quantization} vs bf16 weights, greedy agreement (informational): {quant}")
    if args.json:
        args.json.write_text(json.dumps({"workload": workload.name, "results": summary, "agreement": agree,
                                         "graphs_vs_eager": same}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
