"""Common pieces of the benchmarks in bench/ (the workloads are defined in bench/README.md).

- the benchmark model (``smollm-135m-shape``, random weights, built offline and cached),
- the workloads' requests, generated exactly as bench/README.md defines them, from
  ``random.Random(0)``,
- timing functions (median of N runs),
- the DRAM read-bandwidth measurement (sum over a 512 MB tensor, best of a few),
- the Hugging Face transformers reference runner for W1 (static batches of 16, left
  padding, each batch running until its longest request is done).

Nothing here imports the compiled engine, so the reference side runs on its own.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `python bench/throughput.py` from anywhere
    sys.path.insert(0, str(REPO_ROOT))

BENCH_THREADS = 2
# Before torch (and any OpenMP runtime) is loaded, so every runtime in the process sees it.
os.environ.setdefault("OMP_NUM_THREADS", str(BENCH_THREADS))
os.environ.setdefault("MKL_NUM_THREADS", str(BENCH_THREADS))

import torch  # noqa: E402


def _import_checkpoints():
    """``pyengine.testing.checkpoints``; if the package cannot be imported (its ``__init__``
    needs the compiled extension, which may not be built), the ``pyengine/testing`` folder
    loaded on its own as a package: it depends on nothing else in pyengine."""
    try:
        import pyengine.testing.checkpoints as mod

        return mod
    except ImportError:
        import importlib
        import importlib.util

        name = "_pyengine_testing_standalone"
        if name not in sys.modules:
            folder = REPO_ROOT / "pyengine" / "testing"
            spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])
            package = importlib.util.module_from_spec(spec)
            sys.modules[name] = package
            spec.loader.exec_module(package)
        return importlib.import_module(name + ".checkpoints")


checkpoints = _import_checkpoints()
SMOLLM_135M_SHAPE = checkpoints.SMOLLM_135M_SHAPE
QWEN3_06B_SHAPE = checkpoints.QWEN3_06B_SHAPE
cached_checkpoint = checkpoints.cached_checkpoint

SMOLLM_NAME = "smollm-135m-shape"
SMOLLM_VOCAB = SMOLLM_135M_SHAPE["vocab_size"]
QWEN3_NAME = "qwen3-0.6b-shape"
#: The benchmark models by name (bench/README.md, "The models"): their builder arguments.
BENCH_MODELS = {SMOLLM_NAME: SMOLLM_135M_SHAPE, QWEN3_NAME: QWEN3_06B_SHAPE}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------


def set_threads(n: int = BENCH_THREADS) -> None:
    """Use ``n`` threads in torch (intra-op) and for OpenMP/MKL in anything started later."""
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    os.environ.setdefault("MKL_NUM_THREADS", str(n))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set (interop threads can be set once)
        pass


#: The settings that make the whole process -- pyengine's kernels and torch's (ATen's own
#: kernels, oneDNN, MKL) -- use no more than a lower CPU level's instructions, so that a CPU
#: with more (AVX-512, AVX512-BF16, AMX) measures pyengine *and* transformers as a CPU of that
#: level would run them. `PYENGINE_CPU_ISA` alone lowers pyengine's kernels only: transformers'
#: bf16 matmuls would still run on AMX. "avx2" is AVX2 + FMA + F16C (an AMD EPYC before Zen 4):
#: pyengine also leaves out AVX-VNNI and takes the paths it takes where bf16 matrix work is not
#: native (PYENGINE_BF16_MATMUL=fp32), as it does on such a CPU.
EMULATED_CPU_LEVELS: dict[str, dict[str, str]] = {
    "avx2": {
        "PYENGINE_CPU_ISA": "avx2",
        "PYENGINE_CPU_VNNI": "0",
        "PYENGINE_BF16_MATMUL": "fp32",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}
_EMULATING = "PYENGINE_BENCH_EMULATED_CPU"


def emulate_cpu_level(level: str | None) -> None:
    """Runs this benchmark again, in place of this process, with EMULATED_CPU_LEVELS[level]'s
    settings in its environment (torch reads them when it first uses each library, so they
    cannot be applied to a process that is already running). Returns at once when ``level`` is
    None or the process already runs that way; ValueError for an unknown level."""
    if level is None:
        return
    if level not in EMULATED_CPU_LEVELS:
        raise ValueError(f"unknown CPU level {level!r}; one of {', '.join(EMULATED_CPU_LEVELS)}")
    settings = {**EMULATED_CPU_LEVELS[level], _EMULATING: level}
    if all(os.environ.get(k) == v for k, v in settings.items()):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **settings})


def add_emulate_cpu_option(parser) -> None:
    """``--emulate-cpu LEVEL`` (default None) on an argparse parser; the script passes the
    parsed value to emulate_cpu_level() before it starts any work."""
    parser.add_argument("--emulate-cpu", choices=list(EMULATED_CPU_LEVELS), default=None,
                        help="run both engines compared with no more than this level's instructions "
                             "(bench/common.py EMULATED_CPU_LEVELS; the script restarts itself with them)")


def emulated_cpu_level() -> str | None:
    """The level emulate_cpu_level() set up for this process, if any. ValueError where the
    variable it sets names no level of EMULATED_CPU_LEVELS (set by hand)."""
    level = os.environ.get(_EMULATING)
    if level is not None and level not in EMULATED_CPU_LEVELS:
        raise ValueError(f"{_EMULATING}={level!r} is not a CPU level; one of {', '.join(EMULATED_CPU_LEVELS)} "
                         f"(--emulate-cpu sets it)")
    return level


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers in benchmark output."""
    import warnings

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module="transformers")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    import transformers

    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "loadavg_1m": round(load, 2),
        "emulated_cpu_level": emulated_cpu_level(),
    }


# --------------------------------------------------------------------------------------
# The benchmark model
# --------------------------------------------------------------------------------------


def layer_linear_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int,
                        head_dim: int | None = None) -> dict[str, tuple[int, int]]:
    """The (N, K) weight shapes of a decoder layer's linears: qkv (fused), o, gate_up (fused),
    down; head_dim defaults to hidden / heads."""
    d = head_dim or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * d, hidden), "o": (hidden, heads * d),
            "gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}


#: smollm-135m-shape's layer linears: name -> (N, K)
SMOLLM_LAYER_SHAPES = layer_linear_shapes(SMOLLM_135M_SHAPE["hidden_size"], SMOLLM_135M_SHAPE["intermediate_size"],
                                          SMOLLM_135M_SHAPE["num_heads"], SMOLLM_135M_SHAPE["num_kv_heads"])


def smollm_checkpoint(root: Path | str | None = None) -> Path:
    """The ``smollm-135m-shape`` checkpoint (fp32 weights, 498 MB), built once into the
    checkpoint cache (``root``, else ``$PYENGINE_CHECKPOINT_CACHE``, else
    ``~/.cache/pyengine/checkpoints``) and reused. Both dtypes load it: bf16 runs convert
    at load time."""
    return cached_checkpoint(SMOLLM_NAME, SMOLLM_135M_SHAPE, root=root)


def bench_checkpoint(name: str, root: Path | str | None = None) -> Path:
    """The benchmark model ``name`` (a key of BENCH_MODELS), built once into the checkpoint
    cache (as ``smollm_checkpoint``) and reused: ``qwen3-0.6b-shape`` is saved in bf16
    (1.2 GB; about a minute to build on 2 cores)."""
    if name not in BENCH_MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; one of {', '.join(BENCH_MODELS)}")
    return cached_checkpoint(name, BENCH_MODELS[name], root=root)


COPYING_NAME = "copying-135m-shape"


def copying_checkpoint(root: Path | str | None = None) -> Path:
    """``copying-135m-shape``: smollm-135m-shape's layers, heads and vocabulary with weights
    built by hand to copy its context (pyengine.testing.copying_model: an induction circuit
    in its first two layers, the other 28 read at every step but inert, an untied head;
    143 M parameters, 573 MB in fp32), built once into the checkpoint cache and reused."""
    from pyengine.testing.copying_model import build_copying_checkpoint

    return cached_checkpoint(COPYING_NAME, root=root, builder=build_copying_checkpoint)


# --------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int  # exactly this many tokens are generated (EOS ignored)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    note: str = ""

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def generated_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def w1_requests(
    num_requests: int = 64,
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (16, 256),
    vocab_size: int = SMOLLM_VOCAB,
    seed: int = 0,
) -> list[Request]:
    """W1: ``num_requests`` requests from ``random.Random(seed)``. For each request in
    turn: prompt length ``rng.randint(*prompt_len)`` (inclusive), output length
    ``rng.randint(*output_len)``, then the prompt's token ids, each
    ``rng.randrange(vocab_size)``. The defaults are W1's (64, [32, 512], [16, 256])."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        plen = rng.randint(*prompt_len)
        olen = rng.randint(*output_len)
        out.append(Request([rng.randrange(vocab_size) for _ in range(plen)], olen))
    return out


def w2_request(
    prompt_len: int = 128, output_len: int = 128, vocab_size: int = SMOLLM_VOCAB, seed: int = 0
) -> Request:
    """W2: one request, a 128-token random prompt (``random.Random(seed)``), 128 tokens."""
    rng = random.Random(seed)
    return Request([rng.randrange(vocab_size) for _ in range(prompt_len)], output_len)


def w4_requests(
    num_requests: int = 32,
    shared_len: int = 1024,
    suffix_len: int = 32,
    output_len: int = 64,
    vocab_size: int = SMOLLM_VOCAB,
    seed: int = 0,
) -> list[Request]:
    """W4: a ``shared_len``-token system prompt drawn first from ``random.Random(seed)``,
    then for each request a distinct ``suffix_len``-token suffix; ``output_len`` tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab_size) for _ in range(shared_len)]
    out, seen = [], set()
    while len(out) < num_requests:
        suffix = tuple(rng.randrange(vocab_size) for _ in range(suffix_len))
        if suffix in seen:
            continue
        seen.add(suffix)
        out.append(Request(shared + list(suffix), output_len))
    return out


def w1_workload(quick: bool = False, vocab_size: int = SMOLLM_VOCAB) -> Workload:
    """The W1 requests; ``quick`` shrinks the workload (same generator, same order of
    draws): 16 requests (one reference batch), prompts in [16, 48], outputs in [8, 24]."""
    if quick:
        return Workload(
            "W1-quick",
            w1_requests(16, (16, 48), (8, 24), vocab_size),
            "quick: 16 requests (not 64), prompt lengths in [16, 48] (not [32, 512]), "
            "output lengths in [8, 24] (not [16, 256])",
        )
    return Workload("W1", w1_requests(vocab_size=vocab_size))


def pyengine_bench_args(doc: str | None, argv: list[str] | None, runs: int = 3):
    """The options the pyengine-only scripts share: --dtype, --runs, --quick."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--runs", type=int, default=runs)
    p.add_argument("--quick", action="store_true")
    return p.parse_args(argv)


def w1_engine(model_dir: Path, dtype: str, requests: list[Request], **engine_kwargs: Any):
    """An engine for W1: 64 sequence slots, 2,048-token budget, a pool for every request at once.
    Prefix reuse is off: benchmark runs repeat the same prompts, which reuse would skip."""
    from pyengine import Engine, KvCacheConfig, SchedulerConfig

    kv = max(2048, sum(len(r.prompt_token_ids) + r.max_tokens + 16 for r in requests))
    return Engine(model_dir, dtype=dtype, kv_cache_config=KvCacheConfig(max_tokens=kv, enable_block_reuse=False),
                  scheduler_config=SchedulerConfig(max_batch_size=64, max_num_tokens=2048), **engine_kwargs)


# --------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once; return (seconds, its result)."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def time_runs(fn: Callable[[], Any], runs: int = 3, warmup: int = 0) -> list[float]:
    """Seconds of each of ``runs`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [timed(fn)[0] for _ in range(runs)]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
    """'median [min, max]' for a report line."""
    return f"{median(xs):.4g} [{min(xs):.4g}, {max(xs):.4g}]"


# --------------------------------------------------------------------------------------
# Memory bandwidth
# --------------------------------------------------------------------------------------


def dram_read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """DRAM read bandwidth in bytes/s: the best of ``repeats`` timed ``sum()`` over an
    fp32 tensor of ``nbytes`` (512 MB, far larger than any cache), after one untimed
    pass, both in ordinary 4 KiB pages and in a region of 2 MiB huge pages (where the engine
    keeps its weights: pyengine/runtime/weight_arena.py), the faster of the two. With the
    benchmark's thread count, this is what a batch-1 decode can read."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    huge, = huge_page_copies(x, 1)
    best = float("inf")
    for t in (x, huge):
        t.sum()
        for _ in range(repeats):
            t0 = time.perf_counter()
            t.sum()
            best = min(best, time.perf_counter() - t0)
    del x, huge
    return nbytes / best


def huge_page_copies(t: torch.Tensor, copies: int) -> list[torch.Tensor]:
    """``copies`` copies of ``t`` in one region of huge pages, as the engine keeps its weights
    (pyengine/runtime/weight_arena.py): kernel benchmarks read what a model's forward reads."""
    from pyengine.runtime.weight_arena import WeightArena

    arena = WeightArena.reserve(copies * WeightArena.footprint(t))
    return [arena.copy_in(t) for _ in range(copies)]


def param_bytes(model_dir: Path | str, dtype: torch.dtype) -> int:
    """Bytes of the model's parameters in ``dtype`` (tied weights counted once)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    return n * torch.finfo(dtype).bits // 8


# --------------------------------------------------------------------------------------
# Hugging Face reference
# --------------------------------------------------------------------------------------


def hf_load(model_dir: Path | str, dtype: torch.dtype):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


@dataclass
class RunResult:
    seconds: float
    prompt_tokens: int
    generated_tokens: int
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    cpu_seconds: float = float("nan")  # process CPU time (all threads) during the run

    @property
    def cpu_utilization(self) -> float:
        """CPU time / (wall time x torch threads): near 1 on an idle machine; well below
        1 means the run was starved by other processes (its figure is suspect)."""
        return self.cpu_seconds / (self.seconds * torch.get_num_threads())

    @property
    def generated_tps(self) -> float:
        return self.generated_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.seconds


@torch.inference_mode()
def hf_generate_static(
    model, requests: Sequence[Request], batch_size: int = 16, pad_token_id: int = 0
) -> RunResult:
    """The W1 reference: ``model.generate`` over the requests in order, in static
    batches of ``batch_size`` with left padding; each batch generates exactly as many
    tokens as its longest request (``max_new_tokens`` = ``min_new_tokens`` = that, EOS
    disabled), greedy. Counts only each request's own tokens as generated; the outputs are
    each request's own tokens. A GPU model gets its inputs on its device, and the clock
    stops once the device has finished."""
    from transformers import GenerationConfig

    outputs: list[list[int]] = []
    c0, t0 = time.process_time(), time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        new = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, width - n :] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
            mask[i, width - n :] = 1
        gen_cfg = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=None,
            pad_token_id=pad_token_id,
            bos_token_id=None,
        )
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=gen_cfg)
        if out.shape[1] != width + new:
            raise RuntimeError(
                f"reference generated {out.shape[1] - width} tokens, expected {new}"
            )
        for i, r in enumerate(batch):
            outputs.append(out[i, width : width + r.max_tokens].tolist())
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return RunResult(
        seconds,
        sum(len(r.prompt_token_ids) for r in requests),
        sum(r.max_tokens for r in requests),
        outputs,
        cpu,
    )


def compare_outputs(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, float]:
    """How closely two runs' greedy outputs agree: the fraction of requests with identical
    tokens and the mean fraction of each request's tokens before the first difference.
    (Informational: random-weight models flip on rounding differences.)"""
    same, prefix = 0, 0.0
    for x, y in zip(a, b):
        same += list(x) == list(y)
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix += k / max(len(x), 1)
    n = max(len(a), 1)
    return {"identical": same / n, "common_prefix": prefix / n}
