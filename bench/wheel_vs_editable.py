"""The installed wheel against the editable (source) build: W2 (single stream: TTFT and decode
tok/s) and W1-quick (16 requests: generated tok/s), pyengine only, float32, on
smollm-135m-shape, each interpreter in its own fresh process per round, rounds alternating.
Shows what the wheel's packaging (manylinux repair, torch's OpenMP runtime shared, no
-march=native anywhere in either) costs: nothing, if the ratios sit at 1.0 within the noise.

    python bench/wheel_vs_editable.py --wheel-python /path/to/venv/bin/python [--rounds 3]

The other interpreter (default: this one) runs the editable install. Each child imports
pyengine from its own site-packages: this script copies bench/ to a temporary directory and
runs the children from there, outside the source tree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_info, median, smollm_checkpoint  # noqa: E402

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from bench.common import BENCH_THREADS, set_threads, smollm_checkpoint, w1_workload, w2_request
from bench.latency import pyengine_run
set_threads(BENCH_THREADS)
import pyengine
from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

model_dir = smollm_checkpoint()
res = {"pyengine": pyengine.__file__}
engine = Engine(model_dir, dtype="float32", max_seq_len=512,
                kv_cache_config=KvCacheConfig(max_tokens=2048, enable_block_reuse=False),
                scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=512))
req = w2_request()
pyengine_run(engine, req)  # warm-up
res["w2_ttft_ms"], res["w2_decode_tps"] = (lambda r: (1e3 * r[0], r[1]))(pyengine_run(engine, req))
engine.shutdown()

reqs = w1_workload(quick=True).requests
engine = Engine(model_dir, dtype="float32",
                kv_cache_config=KvCacheConfig(max_tokens=4096, enable_block_reuse=False),
                scheduler_config=SchedulerConfig(max_batch_size=64, max_num_tokens=2048))
prompts = [list(r.prompt_token_ids) for r in reqs]
params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
engine.generate(prompts, params, use_tqdm=False)  # warm-up
t = time.perf_counter()
outs = engine.generate(prompts, params, use_tqdm=False)
res["w1_generated_tps"] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
res["w1_tokens"] = [o.token_ids for o in outs]
engine.shutdown()
print(json.dumps(res))
"""

FIGURES = [("w2_ttft_ms", "W2 TTFT (ms)"), ("w2_decode_tps", "W2 decode tok/s"),
           ("w1_generated_tps", "W1-quick generated tok/s")]


def run_child(python: str, bench_copy: Path) -> dict:
    done = subprocess.run([python, "-c", CHILD, str(bench_copy)], capture_output=True, text=True,
                          cwd=bench_copy, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{python} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheel-python", required=True, help="the python of a virtual environment with the wheel installed")
    p.add_argument("--editable-python", default=sys.executable, help="the python with the editable install")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    smollm_checkpoint()  # built once, here, into the shared checkpoint cache
    pythons = {"wheel": args.wheel_python, "editable": args.editable_python}
    results: dict[str, list[dict]] = {k: [] for k in pythons}
    with tempfile.TemporaryDirectory() as tmp:
        bench_copy = Path(tmp)
        shutil.copytree(Path(__file__).resolve().parent, bench_copy / "bench",
                        ignore=shutil.ignore_patterns("cpp", "__pycache__"))
        for r in range(args.rounds):
            for kind in (("wheel", "editable") if r % 2 == 0 else ("editable", "wheel")):
                results[kind].append(run_child(pythons[kind], bench_copy))
    for kind, rs in results.items():
        print(f"{kind}: pyengine from {rs[0]['pyengine']}")
    tokens = {kind: rs[0]["w1_tokens"] for kind, rs in results.items()}
    same = tokens["wheel"] == tokens["editable"]
    print(f"\nW2 and W1-quick, float32, {machine_info()['cpu']}, {args.rounds} rounds alternating (median); "
          f"W1 tokens identical: {same}\n")
    print("| figure | wheel | editable | wheel / editable |\n|---|---|---|---|")
    for key, name in FIGURES:
        w, e = median([x[key] for x in results["wheel"]]), median([x[key] for x in results["editable"]])
        print(f"| {name} | {w:.1f} | {e:.1f} | {w / e:.3f}x |")
    print("\nper round (W2 TTFT ms / W2 decode tok/s / W1 generated tok/s): " + "; ".join(
        f"{kind} " + ", ".join(f"{x['w2_ttft_ms']:.0f}/{x['w2_decode_tps']:.1f}/{x['w1_generated_tps']:.1f}" for x in rs)
        for kind, rs in results.items()))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
