"""The randomized soak of tests/test_soak.py, long: random add_request / abort_request /
step() / injected faults (forward, logits processor, the batch manager's schedule, real
Ctrl-Cs) through the public API on a small KV pool under max_utilization
with chunked prefill, checked after every operation (see tests/soak_ops.py, which both
use). With --overlap both, the same operations run in lockstep on an engine without and
one with overlap, and every request's final output is compared between them.

    python bench/soak.py                          # 100,000 operations, overlap off and on
    python bench/soak.py --ops 20000 --overlap on --seed 3

Prints operations, steps, faults injected, requests finished by reason, aborts by the
state they hit, and the process RSS (VmRSS) after the warm-up and at the end, with its
growth in %. Exits 1 on any failure (the last operations are printed to replay it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))  # soak_ops: the soak itself, shared with the test

from bench.common import BENCH_THREADS  # noqa: E402  (sets the thread counts before torch loads)

import torch  # noqa: E402

from pyengine.testing.checkpoints import cached_checkpoint  # noqa: E402
from soak_ops import SoakConfig, SoakFailure, SoakRun, run_soak  # noqa: E402

# The shape of the tests' llama_dir checkpoint (tests/conftest.py).
MODEL = dict(model_type="llama", num_heads=4, num_kv_heads=2)
MODES = {"off": {"plain": False}, "on": {"overlap": True}, "both": {"plain": False, "overlap": True}}


def vm_rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def summary(name: str, run: SoakRun) -> str:
    c = run.counts
    aborts = ", ".join(f"{kind} {verdict} {n}" for (kind, verdict), n in sorted(c.aborts.items()))
    return (f"  {name}: {c.steps} steps ({c.failed_steps} failed by injection, {c.interrupted_steps} interrupted by "
            f"Ctrl-C), faults fired "
            f"{dict(sorted(run.faults.fired.items()))}, requests {run.num_added} (finished "
            f"{dict(sorted(c.finished.items()))}), bad add_requests refused {c.bad_adds}, final texts re-decoded "
            f"{c.redecoded}\n"
            f"    aborts: {aborts}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--overlap", choices=sorted(MODES), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--queue", choices=("priority", "fcfs"), default="priority")
    parser.add_argument("--warmup", type=int, default=None,
                        help="operations before the first RSS reading (default: 5%% of --ops, at least 1000)")
    parser.add_argument("--progress", type=int, default=5000, help="print a line every N operations")
    parser.add_argument("--model", default=None, help="a model directory (default: a tiny llama built once)")
    args = parser.parse_args()
    torch.set_num_threads(BENCH_THREADS)
    model = Path(args.model) if args.model else cached_checkpoint("soak-llama", MODEL)
    warmup = args.warmup if args.warmup is not None else max(1000, args.ops // 20)
    warmup = min(warmup, args.ops)
    every = args.progress
    rss: dict[str, int] = {}
    start = time.perf_counter()

    def progress(done: int, runs: dict[str, SoakRun]) -> None:
        if done == warmup:
            rss["warmup"] = vm_rss_kib()
        if done == -1:
            rss["end"] = vm_rss_kib()
            return
        if every and done % every == 0:
            steps = " ".join(f"{n} {r.counts.steps} steps" for n, r in runs.items())
            print(f"[{time.perf_counter() - start:7.1f} s] {done} ops: {steps}, RSS {vm_rss_kib() / 1024:.1f} MiB",
                  flush=True)

    print(f"soak: {args.ops} operations, overlap {args.overlap}, seed {args.seed}, queue {args.queue}, model {model}",
          flush=True)
    cfg = SoakConfig(queue_policy=args.queue)
    try:
        result = run_soak(model, args.seed, args.ops, MODES[args.overlap], cfg, on_progress=progress,
                          progress_every=_gcd_step(every, warmup))
    except SoakFailure as e:
        print(f"FAILED after {time.perf_counter() - start:.1f} s:\n{e}", flush=True)
        return 1
    elapsed = time.perf_counter() - start
    print(f"passed: {result.ops} operations in {elapsed:.1f} s "
          f"({result.compared} requests compared across modes)" if len(result.runs) > 1 else
          f"passed: {result.ops} operations in {elapsed:.1f} s")
    for name, run in result.runs.items():
        print(summary(name, run))
    if result.near_ties:
        print(f"divergences explained by a near-tie in the sampler's choice: {len(result.near_ties)} "
              f"(request, position): {result.near_ties}")
    growth = 100.0 * (rss["end"] - rss["warmup"]) / rss["warmup"]
    print(f"RSS after warm-up ({warmup} ops): {rss['warmup'] / 1024:.1f} MiB; at the end: {rss['end'] / 1024:.1f} MiB; "
          f"growth {growth:+.1f}%")
    return 0


def _gcd_step(every: int, warmup: int) -> int:
    """A progress period that lands on both the print period and the warm-up count."""
    import math
    return math.gcd(every, warmup) if every else warmup


if __name__ == "__main__":
    sys.exit(main())
