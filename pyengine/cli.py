"""Command line: `python -m pyengine demo` and `python -m pyengine generate`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

DEMO_MODEL = dict(model_type="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                  intermediate_size=688, vocab_size=512, max_position_embeddings=1024)
DEMO_PROMPTS = [
    "Once upon a time",
    "The engine schedules requests",
    "In-flight batching keeps the",
    "A paged KV cache stores",
    "Hello, world!",
    "Sequence slots are seats",
    "Chunked prefill splits long prompts",
    "The quick brown fox jumps over the lazy dog",
]


def _demo(args: argparse.Namespace) -> int:
    from pyengine import Engine, SamplingParams, SchedulerConfig
    from pyengine.testing.checkpoints import cached_checkpoint

    if args.model is None:
        model_dir = cached_checkpoint("demo-llama", DEMO_MODEL)
        print(f"No --model given: using a small RANDOM-WEIGHT Llama model built in {model_dir}.\n"
              "Its text is meaningless; it shows the engine working, not a language model.\n")
    else:
        model_dir = Path(args.model)
    engine = Engine(model_dir, dtype=args.dtype, max_seq_len=args.max_seq_len,
                    scheduler_config=SchedulerConfig(max_batch_size=len(DEMO_PROMPTS)))
    prompts = (DEMO_PROMPTS * ((args.num_requests + len(DEMO_PROMPTS) - 1) // len(DEMO_PROMPTS)))[: args.num_requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.model is None)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, r in zip(prompts, results):
        print(f"--- request {r.request_id}: {prompt!r}\n    tokens: {r.token_ids}\n    text:   {r.text!r}")
    generated = sum(len(r.token_ids) for r in results)
    print(f"\n{len(results)} requests, {generated} generated tokens in {elapsed:.2f} s: "
          f"{generated / elapsed:.1f} tokens/s ({args.dtype})")
    engine.shutdown()
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pyengine import Engine, SamplingParams

    engine = Engine(args.model, dtype=args.dtype, max_seq_len=args.max_seq_len)
    engine.add_request(args.prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            if out.finished:
                sys.stdout.write(f"\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]\n")
    engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pyengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a batch of requests (a random-weight model unless --model)")
    demo.add_argument("--model", default=None, help="a local Hugging Face model directory")
    demo.add_argument("--num-requests", type=int, default=16)
    demo.add_argument("--max-tokens", type=int, default=64)
    gen = sub.add_parser("generate", help="stream one prompt's continuation")
    gen.add_argument("--model", required=True, help="a local Hugging Face model directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    for p in (demo, gen):
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
        p.add_argument("--max-seq-len", type=int, default=None)
        p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return _demo(args) if args.command == "demo" else _generate(args)

