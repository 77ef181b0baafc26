"""pyengine and llama.cpp side by side, on the same machine, in the same run.

Builds llama.cpp (the tree vendored in the llama-cpp-python sdist, for this CPU), converts
the benchmark model (--model: smollm-135m-shape, or qwen3-0.6b-shape) to GGUF in f32 and
bf16 and quantizes the f32 file with llama-quantize (Q8_0, Q4_0, Q4_K_M), and measures, per
dtype or format, with the same thread count, alternating llama.cpp and pyengine runs (median
of --repeats):

- pp:      prompt tokens/s of one 128-token prompt    (llama-bench -p 128 -n 0;
           pyengine: 128 / time to first token of one request with max_tokens=1;
           qwen3-0.6b-shape: 512 tokens, --pp to change)
- tg:      batch-1 decode tokens/s, 128 tokens        (llama-bench -p 0 -n 128;
           pyengine: W2's decode rate, 127 tokens after the first, 128-token prompt;
           --tg-prompt 1: after a 1-token prompt, the empty context llama-bench starts from)
- batched: 64 sequences x (128 prompt + 128 generated) (llama-batched-bench -npp 128
           -ntg 128 -npl 64; pyengine: 64 requests through Engine.generate), total and
           generated tokens/s over the whole run's wall time
- memory:  pyengine's resident memory after loading (a fresh process each; bench/memory.py)
           and llama.cpp's peak RSS (llama-bench -p 0 -n 1), next to the weights' bytes

Quantized formats (--dtypes q8_0,q4_0,q4_k,q5_k): pyengine quantizes the checkpoint at load
(Engine(..., dtype="float32", quantization=fmt), q4_k as "q4_k_m", q5_k as "q5_k_m"); llama.cpp
runs the f32 GGUF quantized by llama-quantize to Q8_0, Q4_0, Q4_K_M and Q5_K_M. The tensor types
of each side are printed.
--output-tensor-type FMT gives both sides' output projection that format instead of llama-quantize's
Q6_K (pyengine: lm_head_quantization=FMT; llama-quantize: --output-tensor-type, or
--token-embedding-type for a model that ties it to the embedding table).

    python bench/llamacpp.py --quick        # pp/tg 64, 16 sequences, 1 repeat: a few minutes
    python bench/llamacpp.py                # fp32 and bf16, 3 repeats
    python bench/llamacpp.py --dtypes q8_0,q4_0,q4_k
    python bench/llamacpp.py --model qwen3-0.6b-shape --dtypes float32,bfloat16,q8_0,q4_0,q4_k
    python bench/llamacpp.py --dtypes bfloat16 --repeats 5 --json out.json
    python bench/llamacpp.py --model qwen3-0.6b-shape --dtypes bfloat16,q4_0 --figures tg --tg-prompt 1
    python bench/llamacpp.py --model qwen3-0.6b-shape --dtypes bfloat16,q4_0 --output-tensor-type q4_0 --figures tg
    python bench/llamacpp.py --emulate-cpu avx2   # both as on an AVX2-only CPU (llama.cpp built for it)

The build and the GGUF files are cached (--cache-dir, $PYENGINE_LLAMACPP_CACHE, else
~/.cache/pyengine/llamacpp); the first run needs cmake, a C/C++ compiler and PyPI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llamacpp_build  # noqa: E402
from bench.common import (BENCH_MODELS, BENCH_THREADS, RunResult, add_emulate_cpu_option,  # noqa: E402
                          bench_checkpoint, emulate_cpu_level, emulated_cpu_level, machine_info, median,
                          quiet_transformers, set_threads, w1_requests, w2_request)

# The dtypes and quantized formats compared: the GGUF file llama.cpp runs for each ...
GGUF_TYPE = {"float32": "f32", "bfloat16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k_m",
             "q5_k": "q5_k_m"}
QUANTIZED = ("q8_0", "q4_0", "q4_k", "q5_k")  # pyengine: Engine(..., dtype="float32", quantization=PYENGINE_QUANT[fmt])
# q4_k / q5_k: pyengine's q4_k_m / q5_k_m, llama.cpp's Q4_K_M / Q5_K_M mixtures (Q6_K for some
# layers' v and down projections)
PYENGINE_QUANT = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}
# ... and llama.cpp's KV cache type: as pyengine's (the model's dtype) where the tool allows it:
# llama-bench has no f32 cache, so its fp32 runs keep its default f16 (one sequence of <= 640 tokens:
# a few MB of KV). Quantized formats keep llama.cpp's default f16 in both tools (pyengine's default
# for quantized weights on the CPU is float16 too).
KV_TYPE = {"float32": {"bench": "f16", "batched": "f32"}, "bfloat16": {"bench": "bf16", "batched": "bf16"},
           **{q: {"bench": "f16", "batched": "f16"} for q in QUANTIZED}}
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float32": "float32",
                 "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "q8_0": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k", "q4_k_m": "q4_k", "q5_k": "q5_k", "q5_k_m": "q5_k"}


def pyengine_dtype(name: str) -> tuple[str, str | None]:
    """(Engine dtype, quantization) of a dtype or format name of --dtypes."""
    return ("float32", PYENGINE_QUANT[name]) if name in QUANTIZED else (name, None)


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
    tg_prompt: int = 128  # pyengine's tg: the decode rate after a prompt of this many tokens (W2's)


BUSY_CORES = 0.2  # other processes' CPU use (cores) above which a run is flagged
QUICK = Sizes(pp=64, tg=64, npp=64, ntg=64, npl=16, tg_prompt=64)
MODEL_SIZES = {"smollm-135m-shape": Sizes(), "qwen3-0.6b-shape": Sizes(pp=512)}


def sizes_for(model: str, quick: bool = False, pp: int | None = None, tg_prompt: int | None = None) -> Sizes:
    """The figures' sizes: the model's (pp128, or pp512 for qwen3-0.6b-shape; tg128; 64 x
    (128 + 128)), or --quick's; ``pp`` overrides the prompt length of pp, ``tg_prompt`` the
    prompt pyengine's tg decodes after."""
    base = QUICK if quick else MODEL_SIZES[model]
    return Sizes(**{**vars(base), **({"pp": pp} if pp else {}), **({"tg_prompt": tg_prompt} if tg_prompt else {})})


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
        self.no_repack: set[str] = set()  # runs that crashed with llama.cpp's repacking, rerun without
        self.records: dict[str, list[dict]] = {}
        self.meter: Meter | None = None  # the last run's

    def _run(self, key: str, cmd: list) -> str:
        with Meter(self.threads, children=True) as self.meter:
            r, cmd = llamacpp_build.run_tool(cmd, capture_output=True, text=True)
        self.commands[key] = " ".join([Path(cmd[0]).name] + cmd[1:])
        if llamacpp_build.repack_off(cmd):
            self.no_repack.add(key)
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


def single_stream_engine(model_dir: Path, dtype: str, quantization: str | None = None, max_seq_len: int = 512,
                         max_num_tokens: int = 512, lm_head_quantization: str | None = None):
    """As bench/latency.py (W2) builds it; ``quantization``: quantize the weights at load
    (dtype must then be float32), the output projection in ``lm_head_quantization`` if given.
    Longer prompts than W2's need a larger ``max_seq_len`` (prompt + generated tokens) and
    ``max_num_tokens`` (a prompt in one step)."""
    from pyengine import Engine, KvCacheConfig, SchedulerConfig

    return Engine(model_dir, dtype=dtype, max_seq_len=max_seq_len, quantization=quantization,
                  lm_head_quantization=lm_head_quantization,
                  kv_cache_config=KvCacheConfig(max_tokens=max(2048, max_seq_len), enable_block_reuse=False),
                  scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=max_num_tokens))


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def bench_dtype(dtype: str, model_dir: Path, gguf: Path, lc, args, sizes: Sizes, log, vocab_size: int) -> dict:
    """The speed figures of one dtype or quantized format (a name of --dtypes)."""
    from bench.latency import pyengine_run
    from bench.throughput import WARMUP, PyengineRunner, kv_tokens_needed

    pe_dtype, quant = pyengine_dtype(dtype)
    output = args.output_tensor_type if quant else None
    llama = LlamaRunner(lc, gguf, dtype, args.threads, sizes)
    groups = args.figures
    runs = {k: {"pyengine": [], "llama.cpp": []} for k, _ in figure_keys(groups)}
    cpu = {k: {"pyengine": [], "llama.cpp": []} for k in groups}  # (utilization, others)
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

    max_seq_len = max(512, sizes.pp + 1, sizes.tg_prompt + sizes.tg)
    engine = single_stream_engine(model_dir, pe_dtype, quant, max_seq_len=max_seq_len,
                                  max_num_tokens=max(512, sizes.pp), lm_head_quantization=output)
    plan = float_1d = None
    try:
        if quant:  # the formats quantize-on-load chose, and the 1-D tensors it kept in float32
            from pyengine.models import model_class

            mc = engine.model_config
            plan = engine._parts.quant_plan.summary()
            float_1d = sum(n not in engine._parts.quant_plan.report for n in model_class(mc).weight_names(mc)[0])
        pp_prompt = w2_request(prompt_len=sizes.pp, vocab_size=vocab_size).prompt_token_ids
        # W2: the decode rate after the first token
        tg_req = w2_request(prompt_len=sizes.tg_prompt, output_len=sizes.tg, vocab_size=vocab_size)
        if "tg" in groups:
            pyengine_run(engine, tg_req)  # warm-up
        if "pp" in groups:
            pyengine_prefill_rate(engine, pp_prompt)  # warm-up
            for i in range(args.repeats):
                ll = llama.bench("pp", sizes.pp, 0)
                with Meter(args.threads) as m:
                    pe = pyengine_prefill_rate(engine, pp_prompt)
                record("pp", ll, pe, m, "tok/s", i)
        if "tg" in groups:
            for i in range(args.repeats):
                ll = llama.bench("tg", 0, sizes.tg)
                with Meter(args.threads) as m:
                    pe = pyengine_run(engine, tg_req)[1]
                record("tg", ll, pe, m, "tok/s", i)
    finally:
        engine.shutdown()
    del engine

    if "batched" in groups:
        requests = w1_requests(sizes.npl, (sizes.npp, sizes.npp), (sizes.ntg, sizes.ntg), vocab_size=vocab_size)
        runner = PyengineRunner(model_dir, pe_dtype, requests, kv_tokens_needed(requests, model_dir),
                                quantization=quant, lm_head_quantization=output)
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
    for key, _ in figure_keys(groups):
        pe, ll = median(runs[key]["pyengine"]), median(runs[key]["llama.cpp"])
        figures[key] = {"pyengine": pe, "llama.cpp": ll, "ratio": pe / ll, "runs": runs[key]}
    rec = llama.records.get("tg", [{}])[0]
    return {"gguf": str(gguf), "pyengine": {"dtype": pe_dtype, "quantization": quant, "lm_head_quantization": output,
                                            "quant_plan": plan, "float_1d_tensors": float_1d},
            "llama_cpp_kv_cache_type": llama.kv, "figures": figures, "cpu": cpu,
            "llama_cpp_generation_phase_tps": phase, "llama_cpp_commands": llama.commands,
            "llama_cpp_no_repack": sorted(llama.no_repack),
            "llama_bench_settings": {k: rec.get(k) for k in ("flash_attn", "n_batch", "n_ubatch", "type_k", "type_v",
                                                             "n_threads", "build_commit", "model_type", "cpu_info")}}


def memory_figures(dtype: str, model_dir: Path, gguf: Path, lc, threads: int, log,
                   output_type: str | None = None) -> dict:
    """Resident memory after loading, each engine in a fresh process: pyengine's RSS after
    Engine(...) minus the RSS before it (bench/memory.py), llama.cpp's peak RSS of a
    one-token ``llama-bench`` run (its weights mmap'd from the GGUF)."""
    from bench.memory import peak_rss_of, pyengine_load_rss

    pe_dtype, quant = pyengine_dtype(dtype)
    pe = pyengine_load_rss(model_dir, pe_dtype, quant, threads, lm_head_quantization=output_type if quant else None)
    ll = peak_rss_of([lc.tool("llama-bench"), "-m", gguf, "-p", 0, "-n", 1, "-r", 1, "-t", threads])
    if ll["returncode"] != 0:
        raise RuntimeError(f"{ll['command']} failed ({ll['returncode']})")
    ll["gguf_bytes"] = gguf.stat().st_size
    w = pe["weight_bytes"]["quantized"] + pe["weight_bytes"]["float"]
    loaded = pe["rss_after_load"] - pe["rss_before"]
    log(f"[{dtype}] memory: pyengine RSS after load +{loaded / 1e6:.0f} MB (weights {w / 1e6:.0f} MB, KV pool "
        f"{pe['kv_pool_bytes'] / 1e6:.0f} MB); llama.cpp peak RSS {ll['peak_rss'] / 1e6:.0f} MB (GGUF "
        f"{ll['gguf_bytes'] / 1e6:.0f} MB)")
    return {"pyengine": pe, "llama.cpp": ll}


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f}"


def print_memory_table(memory: dict[str, dict]) -> None:
    print("\nMemory after loading (MB; each engine in a fresh process). pyengine: RSS after Engine(...) minus RSS "
          "just before it; its KV pool (512 tokens) is allocated but not written, so not resident until used. "
          "llama.cpp: **peak** RSS of `llama-bench -p 0 -n 1` (ru_maxrss; weights mmap'd from the GGUF, resident "
          "once read; a 1-token context)")
    print("| dtype | pyengine weights | KV pool | pyengine RSS after load | RSS / weights | of it: checkpoint file "
          "still mapped | RSS after malloc_trim(0) | pyengine peak during load | llama.cpp GGUF file | "
          "llama.cpp peak RSS | peak / GGUF |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    high = []
    for dtype, m in memory.items():
        pe, ll = m["pyengine"], m["llama.cpp"]
        w = pe["weight_bytes"]["quantized"] + pe["weight_bytes"]["float"]
        base = pe["rss_before"]
        loaded = pe["rss_after_load"] - base
        trim = None if pe.get("rss_after_malloc_trim") is None else pe["rss_after_malloc_trim"] - base
        if loaded > 1.2 * w + pe["kv_pool_bytes"]:
            high.append(dtype)
        print(f"| {dtype} | {_mb(w)} | {_mb(pe['kv_pool_bytes'])} | {_mb(loaded)} | {loaded / w:.2f} "
              f"| {_mb(pe['checkpoint_mapped_rss'])} | {_mb(trim)} | {_mb(pe['hwm_after_load'] - base)} "
              f"| {_mb(ll['gguf_bytes'])} | {_mb(ll['peak_rss'])} | {ll['peak_rss'] / ll['gguf_bytes']:.2f} |")
    if high:
        print(f"note: pyengine's RSS after load is above 1.2 x weights + KV pool for {', '.join(high)}: see the "
              "columns 'checkpoint file still mapped' (safetensors' mmap of the checkpoint, kept alive by a tensor "
              "used as loaded, without a copy) and 'RSS after malloc_trim(0)' (freed memory glibc kept)")


def print_mixtures(mixtures: dict[str, dict], output_type: str | None = None) -> None:
    output = f"the output projection {output_type.upper()} (--output-tensor-type)" if output_type else "Q6_K output"
    print(f"\nTensor types of the quantized models (both sides follow llama.cpp's rules: {output}, Q4_K_M's Q6_K "
          "attn_v and ffn_down layers, the same fallbacks where rows do not fit a format, e.g. Q4_K -> Q5_0, "
          "Q6_K -> Q8_0)")
    print("| format | llama.cpp GGUF (llama-quantize), tensors by type | pyengine (quantize-on-load plan), tensors "
          "by format |\n|---|---|---|")
    for dtype, m in mixtures.items():
        ll = ", ".join(f"{k} {v}" for k, v in m["llama.cpp"].items())
        plan = m.get("pyengine") or {}
        pe = ", ".join(f"{k} {v}" for k, v in sorted(plan.items(), key=lambda kv: -kv[1]))
        if m.get("pyengine_float_1d") is not None:
            pe += f", float32 {m['pyengine_float_1d']} (1-D: norms)"
        print(f"| {dtype} ({GGUF_TYPE[dtype].upper()}) | {ll} | {pe or '-'} |")


def print_table(dtype: str, res: dict, sizes: Sizes) -> None:
    kv = res["llama_cpp_kv_cache_type"]
    if dtype in QUANTIZED:
        output = res["pyengine"]["lm_head_quantization"]
        output = f", output projection {output} on both sides" if output else ""
        what = (f"pyengine: quantized at load to {PYENGINE_QUANT[dtype]}, float32 activations, float16 KV cache "
                f"(its default for quantized weights); llama.cpp: GGUF "
                f"{GGUF_TYPE[dtype].upper()} from llama-quantize, KV cache {kv['bench']} (its default) in "
                f"llama-bench and llama-batched-bench{output}")
    else:
        what = (f"GGUF {GGUF_TYPE[dtype]}; llama.cpp KV cache {kv['bench']} in llama-bench, {kv['batched']} in "
                "llama-batched-bench")
    print(f"\n{dtype} ({what}; ratio = pyengine / llama.cpp, > 1: pyengine faster)")
    print("| figure | pyengine | llama.cpp | ratio |\n|---|---|---|---|")
    for key, label in FIGURES:
        if key not in res["figures"]:  # not among --figures
            continue
        f = res["figures"][key]
        print(f"| {label.format(**vars(sizes))} | {f['pyengine']:.1f} | {f['llama.cpp']:.1f} | {f['ratio']:.2f}x |")
    if res["llama_cpp_generation_phase_tps"]:
        phase = median(res["llama_cpp_generation_phase_tps"])
        print(f"(llama-batched-bench's own S_TG, generation phase only: {phase:.1f} tok/s; the table's generated "
              "tok/s count the generated tokens over the whole run, prompts included, for both)")
    cpu = res["cpu"]
    print("CPU per run, llama.cpp / pyengine (own utilization; cores other processes used): " + "; ".join(
        f"{fig} " + " / ".join(", ".join(f"{u:.0%}" + ("" if o is None else f" {o:.2f}") for u, o in cpu[fig][side])
                               for side in ("llama.cpp", "pyengine")) for fig in cpu))
    busy = sum(o is not None and o > BUSY_CORES for fig in cpu.values() for side in fig.values() for _, o in side)
    if busy:
        print(f"warning: other processes used > {BUSY_CORES} cores during {busy} run(s): those figures may be "
              "several times off (OpenMP threads wait for each other); rerun on a quiet machine")


FIGURE_GROUPS = ("pp", "tg", "batched")  # --figures: which runs to make (batched: both batched rows)


def parse_figures(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        name = part.strip().lower()
        if name not in FIGURE_GROUPS:
            raise argparse.ArgumentTypeError(f"unknown figure {part!r} (pp, tg, batched)")
        out.append(name)
    return [g for g in FIGURE_GROUPS if g in out]  # in the script's order


def figure_keys(groups: list[str]) -> list[tuple[str, str]]:
    """The FIGURES rows of the --figures groups."""
    return [(key, label) for key, label in FIGURES if key.split("_")[0] in groups]


def parse_dtypes(text: str) -> list[str]:
    out = []
    for part in text.split(","):
        if part.strip().lower() not in DTYPE_ALIASES:
            raise argparse.ArgumentTypeError(f"unknown dtype or format {part!r} (float32/fp32, bfloat16/bf16, "
                                             "q8_0, q4_0, q4_k/q4_k_m, q5_k/q5_k_m)")
        out.append(DTYPE_ALIASES[part.strip().lower()])
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", type=parse_dtypes, default=["float32", "bfloat16"],
                   help="comma-separated: float32,bfloat16,q8_0,q4_0,q4_k,q5_k (default float32,bfloat16)")
    p.add_argument("--model", choices=list(BENCH_MODELS), default="smollm-135m-shape",
                   help="the benchmark model (default %(default)s)")
    p.add_argument("--pp", type=int, default=None,
                   help="prompt length of pp (default: 128; 512 for qwen3-0.6b-shape; --quick 64)")
    p.add_argument("--tg-prompt", type=int, default=None,
                   help="the prompt pyengine's tg decodes after (default 128: W2's; llama-bench's tg starts from "
                        "an empty context, so 1 compares the same contexts)")
    p.add_argument("--figures", type=parse_figures, default=list(FIGURE_GROUPS),
                   help="comma-separated: which of pp, tg, batched to run (default all)")
    p.add_argument("--output-tensor-type", choices=llamacpp_build.OUTPUT_TENSOR_TYPES, default=None,
                   help="the quantized formats' output projection in this format on both sides (pyengine's "
                        "lm_head_quantization=, llama-quantize's --output-tensor-type) instead of Q6_K")
    p.add_argument("--threads", type=int, default=BENCH_THREADS, help="threads for both engines (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure and engine (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="pp/tg 64, 16 sequences of 64+64, 1 repeat")
    p.add_argument("--no-memory", action="store_true", help="skip the memory figures")
    p.add_argument("--memory-only", action="store_true",
                   help="only the memory figures and tensor types (no speed runs)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help=f"llama.cpp cache root (default ${llamacpp_build.CACHE_ENV}, else ~/.cache/pyengine/llamacpp)")
    p.add_argument("--llama-cpp-python", dest="version", default=llamacpp_build.DEFAULT_VERSION,
                   help="the llama-cpp-python sdist whose llama.cpp to build (default %(default)s)")
    p.add_argument("--build-jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    p.add_argument("--skip-build-check", action="store_true",
                   help="use the cached build as it is, without checking its stamp; fail if there is none")
    p.add_argument("--checkpoint-root", type=Path, default=None, help="checkpoint cache dir")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    add_emulate_cpu_option(p)  # llama.cpp: a build of its own for the level (llamacpp_build.LEVEL_ISA_ARGS)
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1 or args.threads < 1:
        p.error("--repeats and --threads must be >= 1")
    if args.pp is not None and args.pp < 1:
        p.error("--pp must be >= 1")
    if args.tg_prompt is not None and args.tg_prompt < 1:
        p.error("--tg-prompt must be >= 1")
    if args.no_memory and args.memory_only:
        p.error("--no-memory and --memory-only exclude each other")
    if args.output_tensor_type and not any(d in QUANTIZED for d in args.dtypes):
        p.error("--output-tensor-type needs a quantized format among --dtypes (q8_0, q4_0, q4_k, q5_k)")
    sizes = sizes_for(args.model, args.quick, args.pp, args.tg_prompt)
    emulate_cpu_level(args.emulate_cpu)
    try:
        level = emulated_cpu_level()
    except ValueError as e:
        p.error(str(e))

    def log(msg: str) -> None:
        print(msg, flush=True)

    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    set_threads(args.threads)
    quiet_transformers()
    t_start = time.perf_counter()
    root = args.cache_dir or llamacpp_build.default_cache_root()
    t0 = time.perf_counter()
    model_dir = bench_checkpoint(args.model, args.checkpoint_root)
    log(f"model {args.model}: {model_dir} (ready in {time.perf_counter() - t0:.0f} s)")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    try:
        lc = llamacpp_build.build(root, args.version, args.build_jobs, log, trust_cache=args.skip_build_check,
                                  level=level)
        if lc.version != lc.requested_version:
            log(f"note: llama-cpp-python {lc.requested_version} was not available; using {lc.version}")
        ggufs = llamacpp_build.gguf_files(lc, model_dir, args.model, [GGUF_TYPE[d] for d in args.dtypes], log,
                                          threads=args.threads, output_type=args.output_tensor_type)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    conversions = json.loads((next(iter(ggufs.values())).parent / "conversions.json").read_text())

    info = machine_info()
    info["torch_threads"] = args.threads
    flags = llamacpp_build.cpu_flags()
    described = {"pp": f"pp{sizes.pp}", "tg": f"tg{sizes.tg} (pyengine after a {sizes.tg_prompt}-token prompt)",
                 "batched": f"batched {sizes.npl} x ({sizes.npp}+{sizes.ntg})"}
    what = "memory and tensor types only" if args.memory_only else (
        ", ".join(described[g] for g in args.figures) + f"; median of {args.repeats}, alternating llama.cpp / pyengine")
    print(f"\npyengine vs llama.cpp — {'quick: ' if args.quick else ''}{what}")
    as_level = f" as an {level} CPU (both engines held to it)" if level else ""
    print(f"  machine: {info['cpu']} ({' '.join(flags) or 'flags unknown'}){as_level}, {info['logical_cpus']} CPUs, "
          f"{args.threads} threads, load {info['loadavg_1m']}, {info['date']}")
    print(f"  torch {info['torch']}, transformers {info['transformers']}, python {info['python']}")
    print(f"  llama.cpp {lc.commit or 'unknown commit'} (vendored in llama-cpp-python {lc.version}, "
          f"built for {level or 'this CPU'}), "
          f"{lc.stamp.get('compiler') or 'compiler unknown'}, built in {lc.stamp.get('build_seconds', '?')} s")
    print(f"  model: {args.model} {model_dir}; GGUF " + ", ".join(
        f"{p.name} {c['bytes'] / 1e6:.0f} MB (made in {c['seconds']} s)" for p, c in
        ((p, conversions[llamacpp_build.quantized_key(t, args.output_tensor_type)]) for t, p in ggufs.items())))

    results, memory, mixtures = {}, {}, {}
    for dtype in args.dtypes:
        gguf = ggufs[GGUF_TYPE[dtype]]
        if not args.memory_only:
            log(f"\n[{dtype}] ...")
            results[dtype] = bench_dtype(dtype, model_dir, gguf, lc, args, sizes, log, vocab_size)
        if not args.no_memory:
            memory[dtype] = memory_figures(dtype, model_dir, gguf, lc, args.threads, log, args.output_tensor_type)
        if dtype in QUANTIZED:
            plan = (results.get(dtype, {}).get("pyengine", {}).get("quant_plan")
                    or memory.get(dtype, {}).get("pyengine", {}).get("quant_plan"))
            float_1d = (results.get(dtype, {}).get("pyengine", {}).get("float_1d_tensors")
                        or memory.get(dtype, {}).get("pyengine", {}).get("float_1d_tensors"))
            mixtures[dtype] = {"llama.cpp": llamacpp_build.gguf_tensor_types(gguf, lc.tree), "pyengine": plan,
                               "pyengine_float_1d": float_1d}
    for dtype, res in results.items():
        print_table(dtype, res, sizes)
        print("  llama.cpp commands: " + "; ".join(res["llama_cpp_commands"].values()))
        if res["llama_cpp_no_repack"]:
            print(f"  note: llama.cpp crashed with its weight repacking (AMX on this CPU) in {', '.join(res['llama_cpp_no_repack'])}"
                  ": those figures are llama.cpp without repacking (see llamacpp_build.NO_REPACK_ARGS)")
        st = res["llama_bench_settings"]
        fa = {-1: "auto", 0: "off", 1: "on"}.get(st.get("flash_attn"), st.get("flash_attn"))
        print(f"  llama-bench: flash attention {fa}, batch {st.get('n_batch')}, micro-batch {st.get('n_ubatch')}, "
              f"K/V cache {st.get('type_k')}/{st.get('type_v')}, {st.get('n_threads')} threads, build "
              f"{st.get('build_commit')}, model '{st.get('model_type')}'")
    if mixtures:
        print_mixtures(mixtures, args.output_tensor_type)
    if memory:
        print_memory_table(memory)
    print(f"(wall time {time.perf_counter() - t_start:.0f} s)")

    if args.json:
        args.json.write_text(json.dumps({
            "machine": {**info, "cpu_flags": flags},
            "settings": {"model": args.model, "quick": args.quick, "repeats": args.repeats, "threads": args.threads,
                         "figures": args.figures, "output_tensor_type": args.output_tensor_type,
                         **vars(sizes)},
            "llama_cpp": {"llama_cpp_python": lc.version, "requested": lc.requested_version, "commit": lc.commit,
                          "build": lc.stamp, "conversions": conversions},
            "results": results, "memory": memory, "tensor_types": mixtures,
        }, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
