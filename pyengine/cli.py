"""Command line: `python -m pyengine demo` and `python -m pyengine generate`.

An error prints one line, `pyengine: error: <message>`, and exits with status 2;
`--debug` shows the traceback instead."""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path

DEMO_MODEL = dict(model_type="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                  intermediate_size=688, vocab_size=512, max_position_embeddings=1024)
DEMO_CHECKPOINT = "demo-llama"
# The trained demo model shipped in the package (scripts/train_demo_model.py writes it).
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
DEMO_PROMPTS = [
    'The "for" statement',
    "A list comprehension",
    "Exceptions are",
    "The import statement",
    "A class definition",
    "Return a new dictionary",
    "The with statement",
    "Strings are",
]
STREAM_PROMPT = "The try statement"
# Decoding for the trained demo model: greedy, with a mild repetition penalty (a model this
# small otherwise soon repeats itself).
DEMO_REPETITION_PENALTY = 1.3
# The dtypes the engine runs (pyengine.engine.engine.DTYPES), float16 included on the CPU.
DTYPE_CHOICES = ["float32", "bfloat16", "float16"]
EXIT_ERROR = 2


def demo_checkpoint() -> tuple[Path, bool]:
    """The demo's random-weight model (--random) from the checkpoint cache, and whether it was
    built now (True) or reused (False). cached_checkpoint reuses the directory exactly when its
    stamp matches the builder's arguments and library versions; the same test, made before
    the call, tells which one happens."""
    from pyengine.testing import checkpoints

    reused = checkpoints.is_cached(DEMO_CHECKPOINT, DEMO_MODEL)
    return checkpoints.cached_checkpoint(DEMO_CHECKPOINT, DEMO_MODEL), not reused


def num_parameters(model_dir: Path) -> int:
    """Parameters in a directory's *.safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def demo_model() -> Path:
    """The trained demo model shipped with the package; a clear error if its files are missing."""
    if not (DEMO_MODEL_DIR / "model.safetensors").is_file():
        raise FileNotFoundError(f"the demo model is missing from {str(DEMO_MODEL_DIR)!r}: run "
                                "`python scripts/train_demo_model.py` in a source checkout, or use --random or --model")
    return DEMO_MODEL_DIR


class _Wrapper:
    """Writes text as it comes (a stream's pieces), indented by 4, breaking lines at the first
    space past `width` columns; the text's own line breaks are kept."""

    def __init__(self, width: int = 92) -> None:
        self.width, self.col = width, 0

    def write(self, text: str) -> None:
        out = []
        for part in re.split(r"(\n| )", text):
            if part == "\n" or (part == " " and self.col >= self.width):
                out.append("\n")
                self.col = 0
            elif part:
                if self.col == 0:
                    out.append("    ")
                    self.col = 4
                out.append(part)
                self.col += len(part)
        sys.stdout.write("".join(out))
        sys.stdout.flush()

    def end(self) -> None:
        if self.col:
            sys.stdout.write("\n")
        self.col = 0


def _demo(args: argparse.Namespace) -> int:
    from pyengine import Engine, SamplingParams, SchedulerConfig

    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    random_weights = args.random
    if random_weights:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        model_dir, built = demo_checkpoint()
        where = f"built just now in {model_dir}" if built else f"reused from the cache, {model_dir}"
        print(f"--random: using a small RANDOM-WEIGHT Llama model, {where}.\n"
              "Its text is meaningless; it shows the engine working, not a language model.\n")
    elif args.model is None:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                repetition_penalty=DEMO_REPETITION_PENALTY)
        model_dir = demo_model()
        print(f"Model: a {num_parameters(model_dir) / 1e6:.1f} M-parameter Llama trained on CPython's bundled "
              f"documentation by scripts/train_demo_model.py ({model_dir}).\n"
              "It continues text in the style of the Python docs (greedy decoding, repetition penalty "
              f"{DEMO_REPETITION_PENALTY}); it is tiny and not an assistant. --random runs a random-weight "
              "model, --model DIR your own.\n")
    else:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        model_dir = Path(args.model)
    batch = min(len(DEMO_PROMPTS), args.num_requests)
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.num_requests)]
    distinct = len(set(prompts))
    if distinct < len(prompts):
        print(f"{len(prompts)} requests: the {distinct} demo prompts, repeated to make up {len(prompts)}; at most "
              f"{batch} run at once, the others wait in the queue.\nDecoding is greedy, so the repeats of a prompt "
              "give the same tokens: each prompt is shown once, with the ids of its requests.\n")
    with Engine(model_dir, dtype=args.dtype, max_seq_len=args.max_seq_len,
                scheduler_config=SchedulerConfig(max_batch_size=batch), **_quantization_kwargs(args)) as engine:
        start = time.perf_counter()
        results = engine.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        # One entry per distinct (prompt, tokens): a repeat that decoded differently is shown on its own.
        shown: dict[tuple[str, tuple[int, ...]], list] = {}
        for prompt, r in zip(prompts, results):
            shown.setdefault((prompt, tuple(r.token_ids)), []).append(r)
        for (prompt, _), rs in shown.items():
            ids = ", ".join(str(r.request_id) for r in rs)
            print(f"--- {'requests' if len(rs) > 1 else 'request'} {ids}: {prompt!r}")
            if random_weights:
                print(f"    tokens: {rs[0].token_ids}\n    text:   {rs[0].text!r}")
            else:
                wrapper = _Wrapper()
                wrapper.write(f"[{prompt}]{rs[0].text.rstrip()}")
                wrapper.end()
        generated = sum(len(r.token_ids) for r in results)
        batch_line = (f"{len(results)} requests ({distinct} distinct prompts), {generated} generated tokens in "
                      f"{elapsed:.2f} s: {generated / elapsed:.1f} tokens/s ({_weights_label(args)})")

        stream_prompt = STREAM_PROMPT if not random_weights else DEMO_PROMPTS[0]
        print(f"\n--- streamed, token by token as each step produces it: {stream_prompt!r}")
        wrapper = _Wrapper()
        wrapper.write(f"[{stream_prompt}]")
        start = time.perf_counter()
        pieces, final = 0, None
        for out in engine.stream(stream_prompt, params):
            # a random model's bytes escaped, as repr() shows them above
            wrapper.write(repr(out.new_text)[1:-1] if random_weights else out.new_text)
            pieces += 1
            final = out
        stream_elapsed = time.perf_counter() - start
        wrapper.end()
        print(f"    [streamed {len(final.token_ids)} tokens in {pieces} outputs, {stream_elapsed:.2f} s, "
              f"finish_reason={final.finish_reason}]")

        print(f"\n{batch_line}")
        stats = engine.stats()
        print("engine stats: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
        timings = engine.timings()
        steps = int(timings.pop("steps", 0))
        print(f"step timings ({steps} steps): " + ", ".join(f"{k} {v:.3f} s" for k, v in timings.items()))
    return 0


def _sampling_params(args: argparse.Namespace):
    from pyengine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=list(args.stop or []),
                          ignore_eos=args.ignore_eos)


def _generate(args: argparse.Namespace) -> int:
    from pyengine import Engine

    params = _sampling_params(args)  # bad values fail before the model is loaded
    spec = _speculative_config(args)
    with Engine(args.model, dtype=args.dtype, max_seq_len=args.max_seq_len, speculative_config=spec,
                **_quantization_kwargs(args)) as engine:
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
                    if spec is not None:
                        m = out.metrics
                        sys.stderr.write(f"[speculative decoding: {m.num_accepted_draft_tokens} of "
                                         f"{m.num_draft_tokens} draft tokens accepted]\n")
    return 0


def _quantization_kwargs(args: argparse.Namespace) -> dict:
    """--quantization / --lm-head-quantization / --no-quantize-lm-head as Engine's arguments; only
    those given, so that the engine's own checks name a misuse (e.g. an output format without
    --quantization)."""
    kw: dict = {}
    if args.quantization is not None:
        kw["quantization"] = args.quantization
    if args.lm_head_quantization is not None:
        kw["lm_head_quantization"] = args.lm_head_quantization
    if not args.quantize_lm_head:
        kw["quantize_lm_head"] = False
    return kw


def _weights_label(args: argparse.Namespace) -> str:
    """The dtype, and the quantization asked for: "float32", or e.g. "q4_0 weights, output
    projection q8_0, float32 activations"."""
    if args.quantization is None:
        return args.dtype
    if not args.quantize_lm_head:
        output = f", embeddings and output projection {args.dtype}"
    else:
        output = f", output projection {args.lm_head_quantization}" if args.lm_head_quantization else ""
    return f"{args.quantization} weights{output}, {args.dtype} activations"


def _speculative_config(args: argparse.Namespace):
    """--speculative-method / --num-speculative-tokens / --draft-model as a SpeculativeConfig (None: off)."""
    from pyengine import SpeculativeConfig

    method = args.speculative_method
    if method is None and args.draft_model is not None:
        method = "draft_model"
    if method is None:
        if args.num_speculative_tokens is not None:
            raise ValueError("--num-speculative-tokens needs --speculative-method (ngram or draft_model)")
        return None
    kw = {} if args.num_speculative_tokens is None else {"num_speculative_tokens": args.num_speculative_tokens}
    return SpeculativeConfig(method=method, draft_model=args.draft_model, **kw)


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
    demo = sub.add_parser("demo", help="run a batch of requests, then a streamed one, on the bundled demo model "
                                       "(a tiny Llama trained on Python's documentation) or --model / --random")
    which = demo.add_mutually_exclusive_group()
    which.add_argument("--model", default=None, help="a local Hugging Face model directory, or a GGUF file")
    which.add_argument("--random", action="store_true",
                       help="a small random-weight Llama instead of the trained demo model (meaningless text)")
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
    gen.add_argument("--speculative-method", choices=["ngram", "draft_model"], default=None,
                     help="speculative decoding: drafts from prompt lookup (ngram) or from --draft-model")
    gen.add_argument("--num-speculative-tokens", type=int, default=None,
                     help="draft tokens a step verifies at most (default 3)")
    gen.add_argument("--draft-model", default=None, metavar="DIR",
                     help="a smaller model with the same tokenizer that proposes the drafts "
                          "(implies --speculative-method draft_model)")
    for p in (demo, gen):
        p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES,
                       help="weights and activations (default float32; all three run on the CPU)")
        p.add_argument("--max-seq-len", type=int, default=None,
                       help="prompt + generated tokens per request (default: the model's max_position_embeddings)")
        p.add_argument("--quantization", default=None, metavar="FORMAT",
                       help="quantize a float checkpoint's weights at load: q8_0, q5_0, q5_1, q4_0, q4_k, q5_k, "
                            "q6_k, or llama.cpp's mixtures q4_k_s, q4_k_m, q5_k_s, q5_k_m (llama.cpp's block "
                            "formats; needs --dtype float32 on the CPU)")
        p.add_argument("--lm-head-quantization", default=None, metavar="FORMAT",
                       help="with --quantization, the output projection's format instead of q6_k "
                            "(e.g. q4_0: a faster step where the vocabulary is large)")
        p.add_argument("--quantize-lm-head", action=argparse.BooleanOptionalAction, default=True,
                       help="with --quantization, --no-quantize-lm-head keeps the embedding table and output "
                            "projection in --dtype")
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
