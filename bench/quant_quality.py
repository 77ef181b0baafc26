"""Quality of quantize-on-load: each quantized format's next-token distributions against the
unquantized model's, on the same token sequences.

Sequences: --sequences (16) of --length (256) tokens from random.Random(--seed): the
tokenizer's BOS id, then random token ids of the model's vocabulary (llama-perplexity puts BOS
first in every chunk; starting with it keeps both tools on the same tokens).

pyengine: the reference is Engine(model, dtype="float32") -- the checkpoint's weights (fp32 for
smollm-135m-shape, bf16 values for qwen3-0.6b-shape) computed in fp32 -- and each format is
Engine(model, dtype="float32", quantization=fmt) (q4_k: "q4_k_m", q5_k: "q5_k_m", the mixtures of
llama.cpp's Q4_K_M and Q5_K_M files; the KV cache: float16, quantized models' default). Each
engine gets the first token of each sequence as its prompt and is teacher-forced through the
rest by a logits processor (public API: SamplingParams.logits_processors sees each step's raw
logits row, the whole vocabulary): it records the row and forces the sequence's next token. So
every position's full distribution is compared, not a top-N (prompt_logprobs gives at most 20
per position). Per position: KL(reference || quantized) (as llama.cpp's --kl-divergence defines
it) and whether the two argmaxes agree; reported as mean, p99 and max KL and top-1 agreement,
over all positions and over the positions llama-perplexity scores (the second half of each
sequence).

llama.cpp (--llama-cpp, the default when its build is cached): the reference log-probabilities
are written in llama-perplexity's --kl-divergence-base format (its tokens and its 16-bit
log-probability rows), and `llama-perplexity --kl-divergence` runs each quantized GGUF
(llama-quantize: Q8_0, Q4_0, Q4_K_M, Q5_K_M) on those same tokens against that same reference. The f32
GGUF is run the same way: its KL is the floor of the comparison (llama.cpp's fp32 against
pyengine's; near 0 when the two engines compute the same model).

    python bench/quant_quality.py --quick                       # 4 x 64 tokens
    python bench/quant_quality.py                               # smollm-135m-shape, 16 x 256
    python bench/quant_quality.py --model qwen3-0.6b-shape --json quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import struct
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import (BENCH_MODELS, BENCH_THREADS, bench_checkpoint, machine_info, quiet_transformers,  # noqa: E402
                          set_threads)

FORMATS = ("q8_0", "q4_0", "q4_k", "q5_k")
GGUF_TYPE = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}
# q4_k / q5_k: the mixtures of llama.cpp's Q4_K_M / Q5_K_M
PYENGINE_QUANT = {"q8_0": "q8_0", "q4_0": "q4_0", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}


# --------------------------------------------------------------------------------------
# Sequences and statistics
# --------------------------------------------------------------------------------------


def make_sequences(num: int, length: int, vocab_size: int, bos_id: int, seed: int = 0) -> list[list[int]]:
    """``num`` sequences of ``length`` tokens: ``bos_id``, then ids drawn with
    ``random.Random(seed).randrange(vocab_size)``, sequence after sequence."""
    rng = random.Random(seed)
    return [[bos_id] + [rng.randrange(vocab_size) for _ in range(length - 1)] for _ in range(num)]


def kl_rows(ref_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P) of each row, from log-probabilities (float64 sums)."""
    ref = ref_logprobs.double()
    return (ref.exp() * (ref - logprobs.double())).sum(-1)


def summarize(kl: np.ndarray, same_top: np.ndarray) -> dict:
    """Mean, median, p99 and max KL, and the top-1 agreement, over the given positions."""
    kl = np.asarray(kl, dtype=np.float64).ravel()
    return {"positions": int(kl.size), "mean_kl": float(kl.mean()), "median_kl": float(np.median(kl)),
            "p99_kl": float(np.percentile(kl, 99)), "max_kl": float(kl.max()),
            "top1_agreement": float(np.asarray(same_top, dtype=np.float64).mean())}


# --------------------------------------------------------------------------------------
# pyengine: teacher-forced full distributions through a logits processor
# --------------------------------------------------------------------------------------


class _Forcer:
    """A logits processor: hands each raw logits row (as log-probabilities) to ``sink(seq,
    position, row)`` and forces the sequence's next token. The position is the number of
    tokens generated so far, so a re-run of a step (a recomputed request) overwrites."""

    def __init__(self, seq_index: int, tokens: list[int], sink):
        self.i, self.tokens, self.sink = seq_index, tokens, sink

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        pos = len(output_ids)
        self.sink(self.i, pos, torch.log_softmax(row.float(), dim=-1))
        forced = torch.full_like(row, float("-inf"))
        forced[self.tokens[pos + 1]] = 0.0
        return forced


def teacher_forced(engine, sequences: list[list[int]], sink) -> float:
    """Runs every sequence through ``engine`` teacher-forced (all at once, one batch); ``sink``
    receives the log-probabilities at positions 0 .. length-2. Returns the seconds it took."""
    from pyengine import SamplingParams

    params = [SamplingParams(max_tokens=len(s) - 1, temperature=0.0, ignore_eos=True,
                             logits_processors=[_Forcer(i, s, sink)]) for i, s in enumerate(sequences)]
    t0 = time.perf_counter()
    outs = engine.generate([s[:1] for s in sequences], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    for i, (s, out) in enumerate(zip(sequences, outs)):
        if list(out.token_ids) != s[1:]:
            raise RuntimeError(f"sequence {i}: the engine did not follow the forced tokens")
    return seconds


def make_engine(model_dir: Path, dtype: str, quantization: str | None, sequences: list[list[int]]):
    from pyengine import Engine, KvCacheConfig, SchedulerConfig

    n, length = len(sequences), max(map(len, sequences))
    return Engine(model_dir, dtype=dtype, quantization=quantization, max_seq_len=length,
                  kv_cache_config=KvCacheConfig(max_tokens=n * (length + 16), free_memory_fraction=None,
                                                enable_block_reuse=False),
                  scheduler_config=SchedulerConfig(max_batch_size=n, max_num_tokens=max(512, n)))


# --------------------------------------------------------------------------------------
# llama.cpp: the reference in llama-perplexity's --kl-divergence-base format
# --------------------------------------------------------------------------------------


def encode_logprob_rows(logprobs: torch.Tensor) -> np.ndarray:
    """Rows of log-probabilities [R, V] as llama-perplexity stores them (uint16 [R, nv], nv =
    2 * ceil(V / 2) + 4): a float32 scale and minimum, then each log-probability as
    round((lp - min) / scale), with min = max(smallest, largest - 16) and scale = (largest -
    min) / 65535; values at or below min are 0 (perplexity.cpp, log_softmax)."""
    lp = logprobs.float()
    r, v = lp.shape
    nv = 2 * ((v + 1) // 2) + 4
    hi = lp.max(dim=-1).values
    lo = torch.maximum(lp.min(dim=-1).values, hi - 16)
    scale = (hi - lo) / 65535.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round((lp - lo[:, None]) * inv[:, None]).clamp_(0, 65535)
    q = torch.where(lp > lo[:, None], q, torch.zeros_like(q)).to(torch.int32).numpy().astype(np.uint16)
    out = np.zeros((r, nv), dtype=np.uint16)
    out[:, 0:2] = scale.numpy().astype(np.float32).view(np.uint16).reshape(r, 2)
    out[:, 2:4] = lo.numpy().astype(np.float32).view(np.uint16).reshape(r, 2)
    out[:, 4:4 + v] = q
    return out


def decode_logprob_rows(rows: np.ndarray, vocab_size: int) -> np.ndarray:
    """The log-probabilities llama-perplexity reads back from ``encode_logprob_rows``' rows."""
    scale = rows[:, 0:2].copy().view(np.float32)[:, 0]
    lo = rows[:, 2:4].copy().view(np.float32)[:, 0]
    return scale[:, None] * rows[:, 4:4 + vocab_size].astype(np.float32) + lo[:, None]


def write_kld_base(path: Path, sequences: list[list[int]], ref_logprobs, vocab_size: int) -> int:
    """Writes the reference as a llama-perplexity --kl-divergence-base file: "_logits_", n_ctx
    (uint32), n_vocab, n_chunk (int32), the tokens (int32), then per sequence the rows of
    positions n_ctx/2 .. n_ctx-2 (those llama-perplexity scores). ``ref_logprobs[i][pos]``:
    sequence i's log-probabilities at position pos. Returns the rows per sequence."""
    n_ctx, n_chunk = len(sequences[0]), len(sequences)
    first = n_ctx // 2
    with open(path, "wb") as f:
        f.write(b"_logits_" + struct.pack("<Iii", n_ctx, vocab_size, n_chunk))
        f.write(np.asarray(sequences, dtype=np.int32).tobytes())
        for i in range(n_chunk):
            f.write(encode_logprob_rows(torch.from_numpy(np.asarray(ref_logprobs[i][first:n_ctx - 1]))).tobytes())
    return n_ctx - 1 - first


_KLD_PATTERNS = {
    "mean_kl": r"^Mean\s+KLD:\s+(-?[\d.]+)",
    "max_kl": r"^Maximum KLD:\s+(-?[\d.]+)",
    "p99_kl": r"^99\.0%\s+KLD:\s+(-?[\d.]+)",
    "median_kl": r"^Median\s+KLD:\s+(-?[\d.]+)",
    "top1_agreement": r"^Same top p:\s+(-?[\d.]+)",
    "ppl_ratio": r"^Mean PPL\(Q\)/PPL\(base\)\s*:\s+(-?[\d.]+)",
}


def parse_kld_output(text: str) -> dict:
    """The KL divergence statistics `llama-perplexity --kl-divergence` prints (top-1 agreement
    as a fraction)."""
    out = {}
    for key, pattern in _KLD_PATTERNS.items():
        m = re.search(pattern, text, re.M)
        if m:
            out[key] = float(m.group(1)) / (100.0 if key == "top1_agreement" else 1.0)
    if "mean_kl" not in out:
        raise ValueError(f"no KL divergence statistics in llama-perplexity's output:\n{text[-3000:]}")
    return out


def llama_kld(lc, gguf: Path, base: Path, n_ctx: int, threads: int, attempts: int = 3) -> dict:
    """``llama-perplexity --kl-divergence`` of ``gguf`` against the reference in ``base``. Its
    last lines (the statistics) are written by a logging thread that the process does not
    always wait for at exit: a run whose output lacks them is repeated."""
    from bench.llamacpp_build import run_tool  # noqa: PLC0415

    cmd = [str(lc.tool("llama-perplexity")), "-m", str(gguf), "--kl-divergence-base", str(base), "--kl-divergence",
           "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads)]
    for attempt in range(attempts):
        t0 = time.perf_counter()
        r, cmd = run_tool(cmd, capture_output=True)
        text = (r.stdout + b"\n" + r.stderr).decode("utf-8", errors="replace")
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{text[-3000:]}")
        if re.search(_KLD_PATTERNS["top1_agreement"], text, re.M) or attempt == attempts - 1:
            break
    res = parse_kld_output(text)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["command"] = " ".join([Path(cmd[0]).name, *cmd[1:]])
    return res


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(BENCH_MODELS), default="smollm-135m-shape")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated (default %(default)s)")
    p.add_argument("--sequences", type=int, default=None, help="number of sequences (default 16; --quick 4)")
    p.add_argument("--length", type=int, default=None, help="tokens per sequence (default 256; --quick 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="4 sequences of 64 tokens")
    p.add_argument("--threads", type=int, default=BENCH_THREADS)
    p.add_argument("--llama-cpp", choices=["auto", "on", "off"], default="auto",
                   help="also run llama-perplexity --kl-divergence on llama.cpp's quantized GGUFs: on (build "
                        "and convert if needed), off, or auto (only when bench/llamacpp.py's build is cached)")
    p.add_argument("--cache-dir", type=Path, default=None, help="llama.cpp cache root (as bench/llamacpp.py)")
    p.add_argument("--checkpoint-root", type=Path, default=None, help="checkpoint cache dir")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the reference log-probabilities are kept during the run (default: a temporary "
                        "folder; 16 x 255 x vocab float32: 0.5 GB for smollm, 2.5 GB for qwen3)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    n_seq = args.sequences or (4 if args.quick else 16)
    length = args.length or (64 if args.quick else 256)
    formats = [f.strip().lower().replace("_k_m", "_k") for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        p.error(f"unknown format {bad[0]!r} (one of {', '.join(FORMATS)})")
    if n_seq < 1 or length < 4:
        p.error("--sequences must be >= 1 and --length >= 4")

    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    set_threads(args.threads)
    quiet_transformers()
    import logging

    logging.getLogger("pyengine").setLevel(logging.WARNING)
    t_start = time.perf_counter()
    model_dir = bench_checkpoint(args.model, args.checkpoint_root)
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab, bos = cfg["vocab_size"], cfg.get("bos_token_id", 1)
    sequences = make_sequences(n_seq, length, vocab, bos, args.seed)
    positions = length - 1  # positions with a next token: 0 .. length-2
    first = length // 2  # llama-perplexity scores positions first .. length-2
    ref_dtype = "bfloat16 weights" if "bfloat16" in str(BENCH_MODELS[args.model].get("dtype")) else "float32 weights"

    info = machine_info()
    print(f"quantization quality — {args.model} ({model_dir}); {'quick: ' if args.quick else ''}{n_seq} sequences x "
          f"{length} tokens (BOS + random ids, seed {args.seed})")
    print(f"  machine: {info['cpu']}, {args.threads} threads, load {info['loadavg_1m']}, {info['date']}; torch "
          f"{info['torch']}, transformers {info['transformers']}")
    print(f"  reference: pyengine Engine(dtype='float32'), the checkpoint's {ref_dtype} in fp32")

    lc, ggufs = None, {}
    if args.llama_cpp != "off":
        from bench import llamacpp_build

        root = args.cache_dir or llamacpp_build.default_cache_root()
        try:
            if args.llama_cpp == "on":
                lc = llamacpp_build.build(root, llamacpp_build.DEFAULT_VERSION, 2, print)
            else:
                lc = llamacpp_build.build(root, llamacpp_build.DEFAULT_VERSION, 2, print, trust_cache=True)
            ggufs = llamacpp_build.gguf_files(lc, model_dir, args.model, ["f32"] + [GGUF_TYPE[f] for f in formats],
                                              print, threads=args.threads)
        except RuntimeError as e:
            if args.llama_cpp == "on":
                print(f"error: {e}", file=sys.stderr)
                return 2
            print(f"  llama.cpp: skipped ({str(e).splitlines()[0]}); --llama-cpp on builds it")
            lc = None

    with tempfile.TemporaryDirectory(prefix="quant-quality-", dir=args.work_dir) as work:
        ref = np.lib.format.open_memmap(Path(work) / "reference.npy", mode="w+", dtype=np.float32,
                                        shape=(n_seq, positions, vocab))
        ref_top = np.zeros((n_seq, positions), dtype=np.int64)

        def ref_sink(i: int, pos: int, lp: torch.Tensor) -> None:
            if pos < positions:
                ref[i, pos] = lp.numpy()
                ref_top[i, pos] = int(lp.argmax())

        t0 = time.perf_counter()
        engine = make_engine(model_dir, "float32", None, sequences)
        load = time.perf_counter() - t0
        secs = teacher_forced(engine, sequences, ref_sink)
        engine.shutdown()
        del engine
        print(f"  reference: loaded in {load:.1f} s, {n_seq} x {positions} positions in {secs:.1f} s")

        results: dict[str, dict] = {}
        for fmt in formats:
            kl = np.zeros((n_seq, positions), dtype=np.float64)
            same = np.zeros((n_seq, positions), dtype=bool)

            def sink(i: int, pos: int, lp: torch.Tensor) -> None:
                if pos < positions:
                    kl[i, pos] = float(kl_rows(torch.from_numpy(ref[i, pos]), lp))
                    same[i, pos] = int(lp.argmax()) == ref_top[i, pos]

            t0 = time.perf_counter()
            engine = make_engine(model_dir, "float32", PYENGINE_QUANT[fmt], sequences)
            load = time.perf_counter() - t0
            plan = engine._parts.quant_plan.summary()
            secs = teacher_forced(engine, sequences, sink)
            engine.shutdown()
            del engine
            results[fmt] = {"pyengine": {"all": summarize(kl, same), "second_half": summarize(kl[:, first:],
                                                                                               same[:, first:]),
                                         "plan": plan, "load_seconds": round(load, 1), "seconds": round(secs, 1)}}
            a = results[fmt]["pyengine"]["all"]
            print(f"  [{fmt}] pyengine ({plan}): mean KL {a['mean_kl']:.5f}, p99 {a['p99_kl']:.5f}, top-1 "
                  f"{a['top1_agreement']:.1%} ({secs:.0f} s)", flush=True)

        floor = None
        if lc is not None:
            base = Path(work) / "reference.kld"
            rows = write_kld_base(base, sequences, ref, vocab)
            print(f"  llama.cpp: reference written in llama-perplexity's format ({base.stat().st_size / 1e6:.0f} MB, "
                  f"{rows} positions per sequence)")
            try:
                floor = llama_kld(lc, ggufs["f32"], base, length, args.threads)
                print(f"  [f32 GGUF] llama.cpp vs the reference (the floor): mean KL {floor['mean_kl']:.6f}, top-1 "
                      f"{floor.get('top1_agreement', float('nan')):.1%}", flush=True)
                for fmt in formats:
                    res = llama_kld(lc, ggufs[GGUF_TYPE[fmt]], base, length, args.threads)
                    res["tensor_types"] = llamacpp_build.gguf_tensor_types(ggufs[GGUF_TYPE[fmt]], lc.tree)
                    results[fmt]["llama.cpp"] = res
                    print(f"  [{fmt}] llama.cpp {GGUF_TYPE[fmt].upper()}: mean KL {res['mean_kl']:.5f}, p99 "
                          f"{res.get('p99_kl', float('nan')):.5f}, top-1 {res.get('top1_agreement', float('nan')):.1%}",
                          flush=True)
            except (RuntimeError, ValueError) as e:
                print(f"  llama.cpp: failed: {e}")

    print(f"\nKL(reference || quantized) per position and top-1 agreement; {n_seq} x {length} tokens "
          f"({'quick' if args.quick else 'full'}). All: positions 0-{positions - 1} ({n_seq * positions}); "
          f"second half: positions {first}-{positions - 1} ({n_seq * (positions - first)}), those llama-perplexity "
          "scores.")
    print("| format | pyengine mean KL | p99 KL | max KL | top-1 | pyengine, second half: mean KL | p99 KL | top-1 "
          "| llama.cpp GGUF | llama.cpp, second half: mean KL | p99 KL | top-1 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt, r in results.items():
        a, h = r["pyengine"]["all"], r["pyengine"]["second_half"]
        row = (f"| {fmt} | {a['mean_kl']:.5f} | {a['p99_kl']:.5f} | {a['max_kl']:.5f} | {a['top1_agreement']:.1%} "
               f"| {h['mean_kl']:.5f} | {h['p99_kl']:.5f} | {h['top1_agreement']:.1%} |")
        ll = r.get("llama.cpp")
        if ll:
            row += (f" {GGUF_TYPE[fmt].upper()} | {ll['mean_kl']:.5f} | {ll.get('p99_kl', float('nan')):.5f} | "
                    f"{ll.get('top1_agreement', float('nan')):.1%} |")
        else:
            row += " - | - | - | - |"
        print(row)
    if floor:
        print(f"llama.cpp's f32 GGUF against the same reference (how far the two engines' unquantized models differ): "
              f"mean KL {floor['mean_kl']:.6f}, p99 {floor.get('p99_kl', float('nan')):.6f}, top-1 "
              f"{floor.get('top1_agreement', float('nan')):.1%}")
    print(f"(wall time {time.perf_counter() - t_start:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": info, "model": args.model, "sequences": n_seq, "length": length, "seed": args.seed,
            "quick": args.quick, "reference": f"pyengine float32 ({ref_dtype})", "results": results,
            "llama_cpp_floor": floor}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
