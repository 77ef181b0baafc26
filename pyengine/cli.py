"""Command line: `python -m pyengine demo` and `python -m pyengine generate`.

An error prints one line, `pyengine: error: <message>`, and exits with status 2;
`--debug` shows the traceback instead."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

DEMO_MODEL = dict(model_type="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                  intermediate_size=688, vocab_size=512, max_position_embeddings=1024)
DEMO_CHECKPOINT = "demo-llama"
DEMO_PROMPTS = [
    "Once upon a time",
    "The engine schedules requests",
    "In-flight batching keeps the",
    "A paged KV cache stores",
    "Hello, world!",
    "Sequence slots hold per-request state",
    "Chunked prefill splits long prompts",
    "The quick brown fox jumps over the lazy dog",
]
# The dtypes the engine runs (pyengine.engine.engine.DTYPES), float16 included on the CPU.
DTYPE_CHOICES = ["float32", "bfloat16", "float16"]
EXIT_ERROR = 2


def demo_checkpoint() -> tuple[Path, bool]:
    """The demo's random-weight model from the checkpoint cache, and whether it was built
    now (True) or reused (False). cached_checkpoint reuses the directory exactly when its
    stamp matches the builder's arguments and library versions; the same test, made before
    the call, tells which one happens."""
    from pyengine.testing import checkpoints

    reused = checkpoints.is_cached(DEMO_CHECKPOINT, DEMO_MODEL)
    return checkpoints.cached_checkpoint(DEMO_CHECKPOINT, DEMO_MODEL), not reused


def _demo(args: argparse.Namespace) -> int:
    from pyengine import Engine, SamplingParams, SchedulerConfig

    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.model is None)
    if args.model is None:
        model_dir, built = demo_checkpoint()
        where = f"built just now in {model_dir}" if built else f"reused from the cache, {model_dir}"
        print(f"No --model given: using a small RANDOM-WEIGHT Llama model, {where}.\n"
              "Its text is meaningless; it shows the engine working, not a language model.\n")
    else:
        model_dir = Path(args.model)
    batch = min(len(DEMO_PROMPTS), args.num_requests)
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_requests)]
    distinct = len(set(prompts))
    if distinct < len(prompts):
        print(f"{len(prompts)} requests: the {distinct} demo prompts, repeated to make up {len(prompts)}; at most "
              f"{batch} run at once, the others wait in the queue.\nDecoding is greedy, so the repeats of a prompt "
              "give the same tokens: each prompt is shown once, with the ids of its requests.\n")
    with Engine(model_dir, dtype=args.dtype, max_seq_len=args.max_seq_len,
                scheduler_config=SchedulerConfig(max_batch_size=batch)) as engine:
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
    # One entry per distinct (prompt, tokens): a repeat that decoded differently is shown on its own.
    shown: dict[tuple[str, tuple[int, ...]], list] = {}
    for prompt, r in zip(prompts, results):
        shown.setdefault((prompt, tuple(r.token_ids)), []).append(r)
    for (prompt, _), rs in shown.items():
        ids = ", ".join(str(r.request_id) for r in rs)
        print(f"--- {'requests' if len(rs) > 1 else 'request'} {ids}: {prompt!r}\n"
              f"    tokens: {rs[0].token_ids}\n    text:   {rs[0].text!r}")
    generated = sum(len(r.token_ids) for r in results)
    print(f"\n{len(results)} requests ({distinct} distinct prompts), {generated} generated tokens in "
          f"{elapsed:.2f} s: {generated / elapsed:.1f} tokens/s ({args.dtype})")
    return 0


def _sampling_params(args: argparse.Namespace):
    from pyengine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=list(args.stop or []),
                          ignore_eos=args.ignore_eos)


def _generate(args: argparse.Namespace) -> int:
    from pyengine import Engine

    params = _sampling_params(args)  # bad values fail before the model is loaded
    with Engine(args.model, dtype=args.dtype, max_seq_len=args.max_seq_len) as engine:
        engine.add_request(args.prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if args.stream:
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
                if out.finished:
                    if not args.stream:
                        sys.stdout.write(out.text)
                    stop = f", stop_reason={out.stop_reason!r}" if out.stop_reason is not None else ""
                    sys.stdout.write(f"\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}{stop}]\n")
    return 0


def _error_message(e: BaseException) -> str:
    """One line: the message of a user error (bad input, a missing or damaged model), or,
    for anything else (a bug?), the exception's type and message and where to see more."""
    from pyengine import StartupError

    prefix = ""
    if isinstance(e, StartupError):
        prefix, e = f"start-up failed in phase '{e.phase}': ", e.error
    text = " ".join(str(e).split())  # one line
    if isinstance(e, (ValueError, TypeError, OSError)) and text:
        return prefix + text  # the message names the value; the type adds nothing
    return f"{prefix}{type(e).__name__}{': ' + text if text else ''} (--debug shows the traceback)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyengine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a batch of requests (a random-weight model unless --model)")
    demo.add_argument("--model", default=None, help="a local Hugging Face model directory, or a GGUF file")
    demo.add_argument("--num-requests", type=int, default=16,
                      help="requests to run (the 8 demo prompts repeat to make up the number; default 16)")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per request (default 64)")
    gen = sub.add_parser("generate", help="generate one prompt's continuation (streamed by default)")
    gen.add_argument("--model", required=True, help="a local Hugging Face model directory, or a GGUF file")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default) decodes greedily; > 0 samples")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (default 1: off)")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (default -1: off)")
    gen.add_argument("--min-p", type=float, default=0.0,
                     help="drop tokens less likely than MIN_P x the most likely one, in [0, 1] (default 0: off)")
    gen.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    gen.add_argument("--stop", action="append", metavar="STRING",
                     help="stop when the text contains STRING, cut before it (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                     help="print the text as it is generated (default) or all at the end")
    for p in (demo, gen):
        p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                       help="weights and activations (default float32; all three run on the CPU)")
        p.add_argument("--max-seq-len", type=int, default=None,
                       help="prompt + generated tokens per request (default: the model's max_position_embeddings)")
        p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
        # Also accepted after the command; SUPPRESS keeps the top-level value when absent here.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, show the traceback")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return _demo(args) if args.command == "demo" else _generate(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("pyengine: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"pyengine: error: {_error_message(e)}", file=sys.stderr)
        return EXIT_ERROR
