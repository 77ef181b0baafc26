"""KV cache persistence: a conversation's next turn after a restart, with the KV cache saved
and loaded, against a cold start; save and load throughput against the disk.

A 2,000-token conversation prefix (greedy, 8 generated tokens) runs on the smollm-135m-shape
model; the engine saves its KV cache and shuts down; a new engine loads it and runs the next
turn (the prefix plus a 32-token user message). The cold start runs the same next turn on a
fresh engine without the file. Reports both TTFTs and their ratio (the target: <= 10%), the
reused tokens, whether the outputs agree, save and load GB/s, and the disk's sequential
write (fsync'd) and read (page cache dropped for the file) GB/s on a file of the same size
in the same directory.

    python bench/kv_persistence.py               # 2,000-token prefix, 3 runs
    python bench/kv_persistence.py --quick       # 500-token prefix, 1 run
    python bench/kv_persistence.py --dir /mnt/x  # where the files go (default: a temp dir)
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BENCH_THREADS, SMOLLM_VOCAB, machine_info, median, set_threads, smollm_checkpoint  # noqa: E402


def make_engine(model_dir: Path, dtype: str, **kv):
    from pyengine import Engine, KvCacheConfig, SamplingParams, SchedulerConfig

    engine = Engine(model_dir, dtype=dtype, max_seq_len=2048,
                    kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096, **kv),
                    scheduler_config=SchedulerConfig(max_batch_size=1, max_num_tokens=2048))
    # warm-up (under a block: nothing cached); the first forward pays one-time costs
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    return engine


def ttft(engine, prompt: list[int]) -> tuple[float, list[int], int]:
    from pyengine import SamplingParams

    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    return out.metrics.time_to_first_token, out.token_ids, out.metrics.num_reused_tokens


def disk_speed(directory: Path, nbytes: int) -> tuple[float, float]:
    """Sequential write (with fsync) and read (the file's pages dropped first) in GB/s."""
    nbytes = max(nbytes, 64 * 2**20)
    chunk = os.urandom(4 * 2**20)
    path = directory / "disk_speed.bin"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t0) / 1e9
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    while os.read(fd, len(chunk)):
        pass
    read = nbytes / (time.perf_counter() - t0) / 1e9
    os.close(fd)
    path.unlink()
    return write, read


def run_once(model_dir: Path, dtype: str, prefix: list[int], turn: list[int], directory: Path) -> dict:
    path = directory / "conversation.pekv"
    first = make_engine(model_dir, dtype)
    ttft(first, prefix)
    saved = first.save_kv_cache(path)
    first.shutdown()

    restarted = make_engine(model_dir, dtype)
    loaded = restarted.load_kv_cache(path)
    warm_ttft, warm_tokens, reused = ttft(restarted, turn)
    restarted.shutdown()

    cold = make_engine(model_dir, dtype)
    cold_ttft, cold_tokens, _ = ttft(cold, turn)
    cold.shutdown()
    path.unlink()
    return {"warm": warm_ttft, "cold": cold_ttft, "reused": reused, "same": warm_tokens == cold_tokens,
            "bytes": saved["bytes"], "save_gbs": saved["bytes"] / saved["seconds"] / 1e9,
            "load_gbs": loaded["bytes"] / loaded["seconds"] / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dir", type=Path, default=None)
    args = p.parse_args(argv)
    set_threads(BENCH_THREADS)
    runs, prefix_len = (1, 500) if args.quick else (args.runs, 2000)
    rng = random.Random(0)
    prefix = [rng.randrange(3, SMOLLM_VOCAB) for _ in range(prefix_len)]
    # (max_seq_len 2048: the prefix, the 32-token turn and 8 generated tokens fit)
    turn = prefix + [rng.randrange(3, SMOLLM_VOCAB) for _ in range(32)]
    model_dir = smollm_checkpoint()
    info = machine_info()
    print(f"KV persistence — {prefix_len}-token prefix, next turn +32 tokens; {args.dtype}; "
          f"{info['cpu']}, {info['date']}")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        results = []
        for i in range(runs):
            r = run_once(model_dir, args.dtype, prefix, turn, Path(d))
            results.append(r)
            print(f"  run {i + 1}: TTFT cold {r['cold']:.3f} s, after load {r['warm']:.3f} s "
                  f"({r['warm'] / r['cold']:.1%}), reused {r['reused']} tokens, outputs identical {r['same']}; "
                  f"file {r['bytes'] / 1e6:.1f} MB, save {r['save_gbs']:.2f} GB/s, load {r['load_gbs']:.2f} GB/s",
                  flush=True)
        write, read = disk_speed(Path(d), results[0]["bytes"])
    ratio = median([r["warm"] for r in results]) / median([r["cold"] for r in results])
    print(f"\nTTFT after load / cold: {ratio:.1%} (target <= 10%)")
    print(f"save {median([r['save_gbs'] for r in results]):.2f} GB/s vs disk write {write:.2f} GB/s (fsync'd); "
          f"load {median([r['load_gbs'] for r in results]):.2f} GB/s vs disk read {read:.2f} GB/s (page cache dropped; "
          "the load reads a just-written file, usually from the page cache)")
    return 0 if all(r["same"] for r in results) and ratio <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
