"""W5 batch-1 decode of the quantized formats against pyengine's own bf16 path, in one process.

What each format's fewer bytes buy in the whole engine (every kernel, Python and sampling, not
the linear layers alone): one engine per format built from the same checkpoint (`--model`,
default the W5 model qwen3-0.6b-shape), bf16 first, each quantized at load as
`Engine(model, dtype="float32", quantization=FMT)` does -- llama-quantize's rules, the output
projection in Q6_K unless `--lm-head FMT` -- and the engines taking turns run by run, so that
the machine's memory speed, which moves by tens of percent within minutes on a shared host,
hits all of them alike. A run is one request: a `--prompt`-token prompt (1: decode from the
empty context, as llama-bench's tg128) and `--tg` generated tokens, greedy; its figure is the
decode rate after the first token. Reports per format the median tok/s, the median over runs
of the ratio to that round's bf16 run, and the bound that ratio has where every byte streams at
bf16's rate: the bytes of the weights a step reads (linear layers and output projection) in
bf16 over those in the format. Targets (bench/README.md, W5): Q8_0 >= 1.8x, Q4_0 and Q4_K >= 3x.
`--dtype float32`: the ratios against the float32 engine instead (no targets).

`--split`: also the step's parts, timed around the one-call decode's layers
(`CpuDecodeLayers.run`) and output projection (`.logits`); the rest is Python, sampling and the
stream.

    python bench/quant_decode.py                                  # bf16, q8_0, q4_0, q4_k, q4_k_m
    python bench/quant_decode.py --formats q4_0,q4_k --lm-head q4_0 --runs 5
    python bench/quant_decode.py --split --json quant_decode.json
    python bench/quant_decode.py --quick                          # one round of 32 tokens
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_emulate_cpu_option, bench_checkpoint, emulate_cpu_level, machine_info,  # noqa: E402
                          median, set_threads, w2_request)

TARGETS = {"q8_0": 1.8, "q4_0": 3.0, "q4_k": 3.0, "q4_k_m": 3.0}
DEFAULT_FORMATS = "q8_0,q4_0,q4_k,q4_k_m"


def step_weight_bytes(model) -> int:
    """Bytes of the weights one decode step of a pyengine model reads, as it stores them: every
    linear layer and the output projection (the embedding table when tied; a separate input table
    is read one row a token and is left out). Interleaved layouts count what they hold: Q4_K's and
    Q5_K's keep their 6-bit sub-block scales a byte each (148 and 180 bytes a row per 256 weights
    against the file's 144 and 176)."""
    import torch

    from pyengine.quant.weight import QuantizedWeight

    total, seen = 0, set()
    for w in [model.lm_head] + [w for layer in model.layers for w in layer.values()]:
        if id(w) in seen:
            continue
        seen.add(id(w))
        if isinstance(w, QuantizedWeight):
            total += sum(data.numel() * data.element_size() for _, data in w.parts)
        elif isinstance(w, torch.Tensor) and w.dim() == 2:
            total += w.numel() * w.element_size()
    return total


class StepSplit:
    """Wall time inside CpuDecodeLayers.run and .logits (wrapped while it is active)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "StepSplit":
        from pyengine.layers import fused_decode

        cls = fused_decode.CpuDecodeLayers
        for name in ("run", "logits"):
            fn = getattr(cls, name)
            self._saved[name] = fn

            def timed(*args, _fn=fn, _name=name, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self.seconds[_name] += time.perf_counter() - t0

            setattr(cls, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        from pyengine.layers import fused_decode

        for name, fn in self._saved.items():
            setattr(fused_decode.CpuDecodeLayers, name, fn)


def decode_run(engine, req, split: StepSplit | None = None) -> tuple[float, float, int]:
    """(decode tok/s after the first token, seconds after the first token, tokens after it), as
    W2 measures it (bench/latency.py); `split`: cleared at the first token, so that it holds the
    decode steps' times alone."""
    from bench.latency import pyengine_run

    tps = pyengine_run(engine, req, on_first_token=None if split is None else split.seconds.clear)[1]
    n = req.max_tokens - 1  # (greedy with ignore_eos: every request runs to max_tokens)
    return tps, n / tps, n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b-shape", help="a benchmark model (bench/common.py)")
    ap.add_argument("--formats", default=DEFAULT_FORMATS,
                    help=f"quantize-on-load methods beside bf16, comma-separated (default {DEFAULT_FORMATS})")
    ap.add_argument("--lm-head", default=None, help="the output projection's format (default: llama-quantize's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the unquantized engine the ratios are taken against (default bfloat16)")
    ap.add_argument("--runs", type=int, default=3, help="rounds, every engine once a round (default 3)")
    ap.add_argument("--quick", action="store_true", help="one round of 32 generated tokens")
    ap.add_argument("--prompt", type=int, default=1, help="prompt tokens (default 1)")
    ap.add_argument("--tg", type=int, default=128, help="generated tokens (default 128)")
    ap.add_argument("--split", action="store_true", help="also time the layers and the output projection")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    add_emulate_cpu_option(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.tg = 1, 32
    if args.runs < 1 or args.prompt < 1 or args.tg < 2:
        ap.error("--runs and --prompt must be >= 1, --tg >= 2")
    emulate_cpu_level(args.emulate_cpu)
    set_threads()
    from bench.llamacpp import single_stream_engine

    import pyengine

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    model_dir = bench_checkpoint(args.model)
    info = machine_info()
    print(f"# {info['cpu']}, {info['torch_threads']} threads, {info['date']}; {pyengine.cpu_info()}")
    max_seq_len = max(512, args.prompt + args.tg)
    ref = args.dtype
    engines, bytes_ = {}, {}
    engines[ref] = single_stream_engine(model_dir, ref, max_seq_len=max_seq_len)
    bytes_[ref] = step_weight_bytes(engines[ref]._parts.runner.model)
    for fmt in formats:
        e = single_stream_engine(model_dir, "float32", fmt, max_seq_len=max_seq_len, lm_head_quantization=args.lm_head)
        engines[fmt] = e
        bytes_[fmt] = step_weight_bytes(e._parts.runner.model)
    vocab = engines[ref].model_config.vocab_size
    req = w2_request(prompt_len=args.prompt, output_len=args.tg, vocab_size=vocab)
    for e in engines.values():  # warm-up
        decode_run(e, req)

    runs: dict[str, list[dict]] = {k: [] for k in engines}
    try:
        for r in range(args.runs):
            for name, e in engines.items():
                split = StepSplit() if args.split else None
                with split or contextlib.nullcontext():
                    tps, secs, n = decode_run(e, req, split)
                rec = {"tok_s": tps}
                if split:
                    run_ms, head_ms = (1e3 * split.seconds[k] / n for k in ("run", "logits"))
                    rec.update(step_ms=1e3 * secs / n, layers_ms=run_ms, head_ms=head_ms,
                               rest_ms=1e3 * secs / n - run_ms - head_ms)
                runs[name].append(rec)
                print(f"round {r + 1}/{args.runs} {name}: {tps:.1f} tok/s", flush=True)
    finally:
        for e in engines.values():
            e.shutdown()

    figures = {}
    head = args.lm_head or "llama-quantize's (Q6_K)"
    print(f"\nbatch-1 decode, prompt {args.prompt}, {args.tg} generated, median of {args.runs} "
          f"(output projection: {head})")
    cols = f"| format | tok/s | vs own {ref} (per round) | bytes bound | target |"
    if args.split:
        cols += " step ms | layers | head | rest |"
    print(cols)
    print("|" + "---|" * (cols.count("|") - 1))
    for name, recs in runs.items():
        ratios = [rec["tok_s"] / r0["tok_s"] for rec, r0 in zip(recs, runs[ref])]
        bound = bytes_[ref] / bytes_[name]
        fig = {"tok_s": median([x["tok_s"] for x in recs]), "vs_ref": median(ratios), "vs_ref_runs": ratios,
               "step_weight_bytes": bytes_[name], "bytes_bound": bound,
               "target": TARGETS.get(name) if ref == "bfloat16" else None, "runs": recs}
        figures[name] = fig
        target = f">= {fig['target']}x" if fig["target"] else ""
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if name != ref else ""
        line = f"| {name} | {fig['tok_s']:.1f} | {fig['vs_ref']:.2f}x{spread} | {bound:.2f}x | {target} |"
        if args.split:
            line += " " + " | ".join(f"{median([x[k] for x in recs]):.2f}"
                                     for k in ("step_ms", "layers_ms", "head_ms", "rest_ms")) + " |"
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "cpu_info": str(pyengine.cpu_info()), "model": args.model,
                                         "reference_dtype": ref,
                                         "lm_head": args.lm_head, "prompt": args.prompt, "tg": args.tg,
                                         "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
