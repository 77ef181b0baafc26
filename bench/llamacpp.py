"""pyengine and llama.cpp side by side, on the same machine, in the same run.

Builds llama.cpp (the tree vendored in the llama-cpp-python sdist, for this CPU), converts
the benchmark model (smollm-135m-shape) to GGUF in f32 and bf16, and measures, per dtype,
with the same thread count, alternating llama.cpp and pyengine runs (median of --repeats):

- pp:      prompt tokens/s of one 128-token prompt    (llama-bench -p 128 -n 0;
           pyengine: 128 / time to first token of one request with max_tokens=1)
- tg:      batch-1 decode tokens/s, 128 tokens        (llama-bench -p 0 -n 128;
           pyengine: W2's decode rate, 127 tokens after the first, 128-token prompt)
- batched: 64 sequences x (128 prompt + 128 generated) (llama-batched-bench -npp 128
           -ntg 128 -npl 64; pyengine: 64 requests through Engine.generate), total and
           generated tokens/s over the whole run's wall time

    python bench/llamacpp.py --quick        # pp/tg 64, 16 sequences, 1 repeat: a few minutes
    python bench/llamacpp.py                # fp32 and bf16, 3 repeats
    python bench/llamacpp.py --dtypes bfloat16 --repeats 5 --json out.json

The build and the GGUF files are cached (--cache-dir, $PYENGINE_LLAMACPP_CACHE, else
~/.cache/pyengine/llamacpp); the first run needs cmake, a C/C++ compiler and PyPI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp_build  # noqa: E402
from bench.common import (BENCH_THREADS, RunResult, machine_info, median, quiet_transformers,  # noqa: E402
                          set_threads, smollm_checkpoint, w1_requests, w2_request)

GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16"}
# llama.cpp's KV cache type, as pyengine's (the model's dtype) where the tool allows it: llama-bench has
# no f32 cache, so its fp32 runs keep its default f16 (one sequence of <= 256 tokens: a few MB of KV).
KV_TYPE = {"float32": {"bench": "f16", "batched": "f32"}, "bfloat16": {"bench": "bf16", "batched": "bf16"}}
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float32": "float32",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
FIGURES = [  # (key, label); ratio = pyengine / llama.cpp, higher is better for pyengine
    ("pp", "pp{pp}: prompt tok/s (1 sequence)"),
    ("tg", "tg{tg}: decode tok/s (batch 1)"),
    ("batched_total", "batched {npl} x ({npp}+{ntg}): total tok/s"),
    ("batched_generated", "batched {npl} x ({npp}+{ntg}): generated tok/s"),
]


@dataclass
class Sizes:
    pp: int = 128
    tg: int = 128
    npp: int = 128
    ntg: int = 128
    npl: int = 64
    batch: int = 2048  # llama.cpp -b and pyengine's max_num_tokens


BUSY_CORES = 0.2  # other processes' CPU use (cores) above which a run is flagged
QUICK = Sizes(pp=64, tg=64, npp=64, ntg=64, npl=16)


# --------------------------------------------------------------------------------------
# llama.cpp: commands and output parsing
# --------------------------------------------------------------------------------------


def parse_llama_bench(text: str) -> list[dict]:
    """The test records of ``llama-bench -o json`` (a JSON array) or ``-o jsonl`` (one
    object a line), ignoring anything printed around them."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r"^\s*\[", text, re.M):
        try:
            data, _ = decoder.raw_decode(text, m.end() - 1)
        except ValueError:
            continue
        if isinstance(data, list) and data and all(isinstance(d, dict) and "avg_ts" in d for d in data):
            return data
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"avg_ts"' in line:
            out.append(json.loads(line))
    if not out:
        raise ValueError(f"no llama-bench results in its output:\n{text[-2000:]}")
    return out


_MD_COLUMNS = ["pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed"]


def parse_batched_bench(text: str) -> list[dict]:
    """The rows of ``llama-batched-bench``: its ``--output-format jsonl`` lines, or else
    the rows of its markdown table (PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s |
    S_TG t/s | T s | S t/s)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed"' in line:
            rows.append(json.loads(line))
        elif line.startswith("|") and re.fullmatch(r"\|(\s*[\d.]+\s*\|){10}", line):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append({k: (int(c) if k in ("pp", "tg", "pl", "n_kv") else float(c))
                         for k, c in zip(_MD_COLUMNS, cells)})
    if not rows:
        raise ValueError(f"no llama-batched-bench results in its output (is -c at least npl x (npp + ntg)?):\n"
                         f"{text[-2000:]}")
    return rows


class LlamaRunner:
    """Runs llama.cpp's benchmark tools; records each command and its CPU use (model
    loading and the tools' warm-up included)."""

    def __init__(self, lc: llamacpp_build.LlamaCpp, gguf: Path, dtype: str, threads: int, sizes: Sizes):
        self.lc, self.gguf, self.threads, self.s = lc, gguf, threads, sizes
        self.kv = KV_TYPE[dtype]
        self.commands: dict[str, str] = {}
        self.records: dict[str, list[dict]] = {}
        self.meter: Meter | None = None  # the last run's

    def _run(self, key: str, cmd: list) -> str:
        cmd = [str(c) for c in cmd]
        self.commands[key] = " ".join([Path(cmd[0]).name] + cmd[1:])
        with Meter(self.threads, children=True) as self.meter:
            r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{self.commands[key]} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
        return r.stdout + "\n" + r.stderr

    def bench(self, key: str, n_prompt: int, n_gen: int) -> float:
        """Tokens/s of one llama-bench test (-r 1: one timed run after llama-bench's warm-up)."""
        kv = self.kv["bench"]
        out = self._run(key, [self.lc.tool("llama-bench"), "-m", self.gguf, "-p", n_prompt, "-n", n_gen,
                              "-t", self.threads, "-r", 1, "-ctk", kv, "-ctv", kv, "-o", "json"])
        rec = [r for r in parse_llama_bench(out) if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen]
        if len(rec) != 1:
            raise RuntimeError(f"expected one llama-bench record for p={n_prompt} n={n_gen}, got {len(rec)}")
        self.records.setdefault(key, []).append(rec[0])
        return float(rec[0]["avg_ts"])

    def batched(self) -> dict:
        s, kv = self.s, self.kv["batched"]
        out = self._run("batched", [
            self.lc.tool("llama-batched-bench"), "-m", self.gguf, "-c", s.npl * (s.npp + s.ntg), "-b", s.batch,
            "-npp", s.npp, "-ntg", s.ntg, "-npl", s.npl, "-t", self.threads, "-tb", self.threads,
            "-ctk", kv, "-ctv", kv, "--output-format", "jsonl"])
        rows = [r for r in parse_batched_bench(out) if (r["pp"], r["tg"], r["pl"]) == (s.npp, s.ntg, s.npl)]
        if len(rows) != 1:
            raise RuntimeError(f"expected one llama-batched-bench row, got {len(rows)}:\n{out[-2000:]}")
        row = rows[0]
        self.records.setdefault("batched", []).append(row)
        return {"total": row["speed"], "generated": s.npl * s.ntg / row["t"], "generation_phase": row["speed_tg"],
                "seconds": row["t"]}


def _busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy (all CPUs, /proc/stat; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    guest = sum(ticks[8:10])  # already counted in user and nice
    return (sum(ticks) - idle - guest) / os.sysconf("SC_CLK_TCK")


class Meter:
    """CPU use during one run: ``utilization``, this process's CPU time (or its children's,
    for a subprocess) over wall time x threads; ``others``, the cores other processes kept
    busy meanwhile (from /proc/stat; None where there is none). On a quiet machine the first
    is ~100% and the second ~0; a busy neighbour makes figures several times off, not
    slightly (OpenMP threads wait on each other at every barrier)."""

    def __init__(self, threads: int, children: bool = False):
        self.threads, self.children = threads, children

    def _own(self) -> float:
        if self.children:
            ru = resource.getrusage(resource.RUSAGE_CHILDREN)
            return ru.ru_utime + ru.ru_stime
        return time.process_time()

    def __enter__(self) -> "Meter":
        self.b0, self.c0, self.t0 = _busy_seconds(), self._own(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall, own, busy = time.perf_counter() - self.t0, self._own() - self.c0, _busy_seconds()
        self.utilization = own / (wall * self.threads)
        self.others = None if busy is None or self.b0 is None else max(0.0, (busy - self.b0 - own) / wall)


# --------------------------------------------------------------------------------------
# pyengine
# --------------------------------------------------------------------------------------


def pyengine_prefill_rate(engine, prompt: list[int]) -> float:
    """Prompt tokens/s: the prompt's length over the time to the first (only) token."""
    from pyengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    first = None
    for _ in engine.stream(prompt, params):
        if first is None:
            first = time.perf_counter()
    return len(prompt) / (first - t0)


def single_stream_engine(model_dir: Path, dtype: str):
    """As bench/latency.py (W2) builds it."""
    from pyengine import Engine, KvCacheConfig, SchedulerConfig

    return Engine(model_dir, dtype=dtype, max_seq_len=512,
                  kv_cache_config=KvCacheConfig(max_tokens=2048, enable_block_reuse=False),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=512))


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def bench_dtype(dtype: str, model_dir: Path, gguf: Path, lc, args, sizes: Sizes, log) -> dict:
    from bench.latency import pyengine_run
    from bench.throughput import WARMUP, PyengineRunner, kv_tokens_needed

    llama = LlamaRunner(lc, gguf, dtype, args.threads, sizes)
    runs = {k: {"pyengine": [], "llama.cpp": []} for k, _ in FIGURES}
    cpu = {k: {"pyengine": [], "llama.cpp": []} for k in ("pp", "tg", "batched")}  # (utilization, others)
    phase: list[float] = []  # llama-batched-bench's S_TG

    def record(key: str, ll: float, pe: float, pe_meter: Meter, unit: str, i: int) -> None:
        runs[key]["llama.cpp"].append(ll)
        runs[key]["pyengine"].append(pe)
        msg = []
        for side, value, m in (("llama.cpp", ll, llama.meter), ("pyengine", pe, pe_meter)):
            cpu[key.split("_")[0]][side].append((round(m.utilization, 3), m.others and round(m.others, 2)))
            others = "" if m.others is None else f", others {m.others:.2f} cores"
            msg.append(f"{side} {value:.1f} {unit} (cpu {m.utilization:.0%}{others})")
        log(f"[{dtype}] {key} run {i + 1}/{args.repeats}: " + ", ".join(msg))

    engine = single_stream_engine(model_dir, dtype)
    try:
        pp_prompt = w2_request(prompt_len=sizes.pp).prompt_token_ids
        tg_req = w2_request(prompt_len=sizes.pp, output_len=sizes.tg)  # W2: decode rate after the first token
        pyengine_run(engine, tg_req)  # warm-up
        for i in range(args.repeats):
            ll = llama.bench("pp", sizes.pp, 0)
            with Meter(args.threads) as m:
                pe = pyengine_prefill_rate(engine, pp_prompt)
            record("pp", ll, pe, m, "tok/s", i)
        for i in range(args.repeats):
            ll = llama.bench("tg", 0, sizes.tg)
            with Meter(args.threads) as m:
                pe = pyengine_run(engine, tg_req)[1]
            record("tg", ll, pe, m, "tok/s", i)
    finally:
        engine.shutdown()

    requests = w1_requests(sizes.npl, (sizes.npp, sizes.npp), (sizes.ntg, sizes.ntg))
    runner = PyengineRunner(model_dir, dtype, requests, kv_tokens_needed(requests, model_dir))
    try:
        runner.run(WARMUP)
        for i in range(args.repeats):
            ll = llama.batched()
            with Meter(args.threads) as m:
                pe: RunResult = runner.run(requests)
            phase.append(ll["generation_phase"])
            runs["batched_generated"]["llama.cpp"].append(ll["generated"])
            runs["batched_generated"]["pyengine"].append(pe.generated_tps)
            record("batched_total", ll["total"], pe.total_tps, m, "total tok/s", i)
    finally:
        runner.close()

    figures = {}
    for key, _ in FIGURES:
        pe, ll = median(runs[key]["pyengine"]), median(runs[key]["llama.cpp"])
        figures[key] = {"pyengine": pe, "llama.cpp": ll, "ratio": pe / ll, "runs": runs[key]}
    rec = llama.records.get("tg", [{}])[0]
    return {"gguf": str(gguf), "llama_cpp_kv_cache_type": llama.kv, "figures": figures, "cpu": cpu,
            "llama_cpp_generation_phase_tps": phase, "llama_cpp_commands": llama.commands,
            "llama_bench_settings": {k: rec.get(k) for k in ("flash_attn", "n_batch", "n_ubatch", "type_k", "type_v",
                                                             "n_threads", "build_commit", "model_type", "cpu_info")}}


def print_table(dtype: str, res: dict, sizes: Sizes) -> None:
    kv = res["llama_cpp_kv_cache_type"]
    print(f"\n{dtype} (GGUF {GGUF_TYPE[dtype]}; llama.cpp KV cache {kv['bench']} in llama-bench, {kv['batched']} in "
          f"llama-batched-bench; "
          "ratio = pyengine / llama.cpp, > 1: pyengine faster)")
    print("| figure | pyengine | llama.cpp | ratio |\n|---|---|---|---|")
    for key, label in FIGURES:
        f = res["figures"][key]
        print(f"| {label.format(**vars(sizes))} | {f['pyengine']:.1f} | {f['llama.cpp']:.1f} | {f['ratio']:.2f}x |")
    phase = median(res["llama_cpp_generation_phase_tps"])
    print(f"(llama-batched-bench's own S_TG, generation phase only: {phase:.1f} tok/s; the table's generated tok/s "
          "count the generated tokens over the whole run, prompts included, for both)")
    cpu = res["cpu"]
    print("CPU per run, llama.cpp / pyengine (own utilization; cores other processes used): " + "; ".join(
        f"{fig} " + " / ".join(", ".join(f"{u:.0%}" + ("" if o is None else f" {o:.2f}") for u, o in cpu[fig][side])
                               for side in ("llama.cpp", "pyengine")) for fig in cpu))
    busy = sum(o is not None and o > BUSY_CORES for fig in cpu.values() for side in fig.values() for _, o in side)
    if busy:
        print(f"warning: other processes used > {BUSY_CORES} cores during {busy} run(s): those figures may be "
              "several times off (OpenMP threads wait for each other); rerun on a quiet machine")


def parse_dtypes(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        if part.strip().lower() not in DTYPE_ALIASES:
            raise argparse.ArgumentTypeError(f"unknown dtype {part!r} (float32/fp32, bfloat16/bf16)")
        out.append(DTYPE_ALIASES[part.strip().lower()])
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=parse_dtypes, default=["float32", "bfloat16"],
                   help="comma-separated: float32,bfloat16 (default both)")
    p.add_argument("--threads", type=int, default=BENCH_THREADS, help="threads for both engines (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure and engine (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="pp/tg 64, 16 sequences of 64+64, 1 repeat")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help=f"llama.cpp cache root (default ${llamacpp_build.CACHE_ENV}, else ~/.cache/pyengine/llamacpp)")
    p.add_argument("--llama-cpp-python", dest="version", default=llamacpp_build.DEFAULT_VERSION,
                   help="the llama-cpp-python sdist whose llama.cpp to build (default %(default)s)")
    p.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    p.add_argument("--skip-build-check", action="store_true",
                   help="use the cached build as it is, without checking its stamp; fail if there is none")
    p.add_argument("--checkpoint-root", type=Path, default=None, help="checkpoint cache dir")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    sizes = QUICK if args.quick else Sizes()

    def log(msg: str) -> None:
        print(msg, flush=True)

    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    set_threads(args.threads)
    quiet_transformers()
    t_start = time.perf_counter()
    root = args.cache_dir or llamacpp_build.default_cache_root()
    model_dir = smollm_checkpoint(args.checkpoint_root)
    try:
        lc = llamacpp_build.build(root, args.version, args.build_jobs, log, trust_cache=args.skip_build_check)
        if lc.version != lc.requested_version:
            log(f"note: llama-cpp-python {lc.requested_version} was not available; using {lc.version}")
        ggufs = llamacpp_build.gguf_files(lc, model_dir, "smollm-135m-shape", [GGUF_TYPE[d] for d in args.dtypes], log)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    conversions = json.loads((next(iter(ggufs.values())).parent / "conversions.json").read_text())

    info = machine_info()
    info["torch_threads"] = args.threads
    flags = llamacpp_build.cpu_flags()
    print(f"\npyengine vs llama.cpp — {'quick: ' if args.quick else ''}pp{sizes.pp}, tg{sizes.tg}, batched "
          f"{sizes.npl} x ({sizes.npp}+{sizes.ntg}); median of {args.repeats}, alternating llama.cpp / pyengine")
    print(f"  machine: {info['cpu']} ({' '.join(flags) or 'flags unknown'}), {info['logical_cpus']} CPUs, "
          f"{args.threads} threads, load {info['loadavg_1m']}, {info['date']}")
    print(f"  torch {info['torch']}, transformers {info['transformers']}, python {info['python']}")
    print(f"  llama.cpp {lc.commit or 'unknown commit'} (vendored in llama-cpp-python {lc.version}), "
          f"{lc.stamp.get('compiler') or 'compiler unknown'}, built in {lc.stamp.get('build_seconds', '?')} s")
    print(f"  model: smollm-135m-shape {model_dir}; GGUF " + ", ".join(
        f"{t} {conversions[t]['bytes'] / 1e6:.0f} MB (converted in {conversions[t]['seconds']} s)" for t in ggufs))

    results = {}
    for dtype in args.dtypes:
        log(f"\n[{dtype}] ...")
        results[dtype] = bench_dtype(dtype, model_dir, ggufs[GGUF_TYPE[dtype]], lc, args, sizes, log)
    for dtype, res in results.items():
        print_table(dtype, res, sizes)
        print("  llama.cpp commands: " + "; ".join(res["llama_cpp_commands"].values()))
        st = res["llama_bench_settings"]
        fa = {-1: "auto", 0: "off", 1: "on"}.get(st.get("flash_attn"), st.get("flash_attn"))
        print(f"  llama-bench: flash attention {fa}, batch {st.get('n_batch')}, micro-batch {st.get('n_ubatch')}, "
              f"K/V cache {st.get('type_k')}/{st.get('type_v')}, {st.get('n_threads')} threads, build "
              f"{st.get('build_commit')}, model '{st.get('model_type')}'")
    print(f"(wall time {time.perf_counter() - t_start:.0f} s)")

    if args.json:
        args.json.write_text(json.dumps({
            "machine": {**info, "cpu_flags": flags},
            "settings": {"quick": args.quick, "repeats": args.repeats, "threads": args.threads, **vars(sizes)},
            "llama_cpp": {"llama_cpp_python": lc.version, "requested": lc.requested_version, "commit": lc.commit,
                          "build": lc.stamp, "conversions": conversions},
            "results": results,
        }, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
