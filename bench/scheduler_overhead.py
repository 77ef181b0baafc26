"""W3 — scheduler overhead: the batch manager alone, from Python through the bindings and
from C++ (bench/cpp/scheduler_overhead.cpp, built here with CMake).

256 requests in generation, 16-token blocks, prompt 128 tokens, 64..256 new tokens each;
each step schedules, fills the forward metadata, takes one token per request (from a
preallocated buffer) and retires the finished; new requests arrive as others finish.
Two Python figures: the bare loop, and the loop that also reads the step's events (what
Engine.step does with them). Medians of 5 rounds.

    python bench/scheduler_overhead.py [--no-cpp]
"""

from __future__ import annotations

import argparse
import array
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def python_figures(steps: int = 2000) -> tuple[float, float]:
    from pyengine.core._core import CoreBatchManager

    bm = CoreBatchManager(max_batch_size=256, max_num_tokens=8192, max_seq_len=1024, tokens_per_block=16,
                          num_blocks=256 * 64 + 64, enable_block_reuse=True)
    rng = random.Random(0)
    # Arrivals are drawn beforehand, so that the timed loop measures the engine, not random().
    arrivals = [(array.array("i", [rng.randrange(32000) for _ in range(128)]), rng.randint(64, 256))
                for _ in range(1024)]
    next_id = 0

    def add() -> None:
        nonlocal next_id
        prompt, max_new = arrivals[next_id % len(arrivals)]
        bm.add_request(next_id, prompt, max_new)
        next_id += 1

    for _ in range(256):
        add()
    tokens = torch.full((256,), 5, dtype=torch.int32)
    ptr = tokens.data_ptr()

    def step(read_events: bool) -> None:
        _, _, n = bm.schedule(0.0)
        bm.update_from_ptr(ptr, n, 0.0)
        bm.events()  # the schedule's events (aborted, paused, newly seated), as Engine.step reads them
        finished = bm.num_finished
        if read_events:  # what Engine.step() walks: one entry per request
            for _rid, _tok, _done, _reason, _row in bm.step_outputs():
                pass
        bm.free_finished()
        for _ in range(finished):
            add()

    for _ in range(300):
        step(False)
    figures = []
    for read_events in (False, True):
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(steps):
                step(read_events)
            rounds.append((time.perf_counter() - t0) / steps * 1e6)
        figures.append(statistics.median(rounds))
    return figures[0], figures[1]


def cpp_figure() -> str:
    build = REPO / "build" / "bench"
    subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), "-DPYENGINE_BUILD_BENCH=ON",
                    "-DCMAKE_BUILD_TYPE=Release"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "scheduler_overhead", "-j", "2"], check=True,
                   capture_output=True)
    return subprocess.run([str(build / "scheduler_overhead")], check=True, capture_output=True,
                          text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-cpp", action="store_true", help="skip building and running the C++ figure")
    args = p.parse_args(argv)
    bare, with_events = python_figures()
    print(f"W3 Python: {bare:.1f} us per step (schedule + metadata + update + retire), "
          f"{with_events:.1f} us with the step's events read (target <= 100 us)")
    if not args.no_cpp:
        print(cpp_figure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
