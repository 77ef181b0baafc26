"""W7 — constrained output: W1 reduced to 32 requests (prompts 32-256, outputs 16-128), every
request constrained by one moderate JSON schema (nested objects, arrays, enums, 20 properties),
at batch 16 and 64: the mean step time against the same requests unconstrained (same engine
settings, alternating runs; each unconstrained request generates as many tokens as its
constrained twin did, so both runs schedule the same sequences in every step), the first compile
(the engine's grammar compiler built from the tokenizer, then the schema) and a cached compile,
and the share of outputs that are valid.

The model is smollm-135m-shape (random weights, 49,152-token vocabulary). Its test tokenizer
has 512 tokens, which would make the grammar masks unrealistically cheap: this benchmark trains
a byte-level BPE tokenizer of the model's full vocabulary on the Python standard library's
sources (once, cached) and runs with it.

    python bench/guided.py --quick
    python bench/guided.py --runs 3
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (BENCH_THREADS, SMOLLM_VOCAB, machine_info, median, pyengine_bench_args,  # noqa: E402
                          set_threads, smollm_checkpoint, w1_requests)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["robot", "drone", "arm", "camera"]},
        "active": {"type": "boolean"},
        "battery": {"type": "number", "minimum": 0, "maximum": 100},
        "position": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                                      "z": {"type": "number"}},
                     "required": ["x", "y", "z"], "additionalProperties": False},
        "heading": {"type": "integer", "minimum": 0, "maximum": 359},
        "mode": {"enum": ["idle", "moving", "charging", "error"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "action": {"type": "object", "properties": {
            "verb": {"enum": ["move", "grip", "release", "stop", "wait"]},
            "target": {"type": "string", "maxLength": 10},
            "speed": {"type": "number", "minimum": 0, "maximum": 2}},
            "required": ["verb", "speed"], "additionalProperties": False},
        "priority": {"enum": ["low", "normal", "high"]},
        "errors": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 2},
    },
    "required": ["id", "name", "kind", "active", "battery", "position", "mode", "action"],
    "additionalProperties": False,
}
NUM_PROPERTIES = 20  # (12 at the top level, 8 nested)
TOKENIZER_DIR = Path.home() / ".cache" / "pyengine" / "tokenizers" / f"stdlib-bpe-{SMOLLM_VOCAB}"


def stdlib_tokenizer() -> Path:
    """A byte-level BPE tokenizer of SMOLLM_VOCAB tokens trained on the standard library's
    sources (deterministic for a given Python and tokenizers version), built once."""
    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return TOKENIZER_DIR
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = []
    for f in files:
        if "site-packages" in f.parts or "test" in f.parts:
            continue
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=SMOLLM_VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    TOKENIZER_DIR.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(TOKENIZER_DIR))
    return TOKENIZER_DIR


def main(argv: list[str] | None = None) -> int:
    args = pyengine_bench_args(__doc__, argv)
    set_threads(BENCH_THREADS)
    import jsonschema

    from pyengine import Engine, GuidedDecodingParams, KvCacheConfig, SamplingParams, SchedulerConfig

    n, prompts_range, outputs_range = (8, (16, 48), (8, 32)) if args.quick else (32, (32, 256), (16, 128))
    requests = w1_requests(n, prompts_range, outputs_range)
    model_dir = smollm_checkpoint()
    t0 = time.perf_counter()
    tok_dir = stdlib_tokenizer()
    print(f"W7 — {n} requests, prompts {prompts_range}, outputs {outputs_range}, JSON schema of {NUM_PROPERTIES} "
          f"properties, {args.dtype}, {machine_info()['cpu']} (tokenizer ready in {time.perf_counter() - t0:.1f} s)")
    prompts = [r.prompt_token_ids for r in requests]
    guided = GuidedDecodingParams(json=SCHEMA)
    rows = []
    for batch in (16, 64):
        kv = sum(len(p) + r.max_tokens + 16 for p, r in zip(prompts, requests))
        engine = Engine(model_dir, dtype=args.dtype, tokenizer=tok_dir,
                        kv_cache_config=KvCacheConfig(max_tokens=max(kv, 2048), enable_block_reuse=False),
                        scheduler_config=SchedulerConfig(max_batch_size=batch, max_num_tokens=2048))
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        table = engine._requests
        t = time.perf_counter()
        backend = table.grammar_backend()
        t_backend = time.perf_counter() - t
        t = time.perf_counter()
        backend.compile(guided)
        t_first = time.perf_counter() - t
        t = time.perf_counter()
        backend.compile(GuidedDecodingParams(json=dict(SCHEMA)))
        t_cached = time.perf_counter() - t
        constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=r.max_tokens, guided_decoding=guided)
                       for i, r in enumerate(requests)]
        # A constrained request ends where its JSON ends, mostly before max_tokens. The unconstrained
        # run generates exactly as many tokens per request (ignore_eos), so both runs have the same
        # schedule (same sequences in every step) and their step times compare like for like.
        lengths = [len(o.token_ids) for o in engine.generate(prompts, constrained, use_tqdm=False)]
        params = {
            "unconstrained": [SamplingParams(temperature=1.0, seed=i, max_tokens=n_out, ignore_eos=True)
                              for i, n_out in enumerate(lengths)],
            "json": constrained,
        }
        step_ms: dict[str, list[float]] = {k: [] for k in params}
        num_steps: dict[str, set[int]] = {k: set() for k in params}
        valid = total = ended = 0
        for _ in range(args.runs):
            for kind, ps in params.items():
                engine.reset_timings()
                t = time.perf_counter()
                outs = engine.generate(prompts, ps, use_tqdm=False)
                elapsed = time.perf_counter() - t
                steps = engine.timings()["steps"]
                step_ms[kind].append(1000 * elapsed / steps)
                num_steps[kind].add(int(steps))
                if [len(o.token_ids) for o in outs] != lengths:
                    raise RuntimeError(f"{kind}: output lengths differ from the first constrained run's")
                if kind == "json":
                    for o in outs:
                        total += 1
                        if o.finish_reason == "stop":
                            ended += 1
                            try:
                                jsonschema.validate(json.loads(o.text), SCHEMA)
                                valid += 1
                            except (ValueError, jsonschema.ValidationError):
                                pass
        if len(num_steps["json"] | num_steps["unconstrained"]) != 1:
            raise RuntimeError(f"the runs' schedules differ: steps {num_steps}")
        free, json_ms = median(step_ms["unconstrained"]), median(step_ms["json"])
        rows.append((batch, free, json_ms, t_backend, t_first, t_cached, valid, ended, total))
        print(f"  batch {batch}: step {free:.1f} ms unconstrained, {json_ms:.1f} ms constrained "
              f"({json_ms / free:.3f}x)", flush=True)
        engine.shutdown()
    print("\n| batch | step, unconstrained (ms) | step, JSON schema (ms) | ratio | grammar compiler (s) "
          "| first compile (ms) | cached compile (ms) | complete / valid / outputs |\n|---|---|---|---|---|---|---|---|")
    for batch, free, json_ms, tb, tf, tc, valid, ended, total in rows:
        print(f"| {batch} | {free:.1f} | {json_ms:.1f} | {json_ms / free:.3f}x | {tb:.2f} | {1000 * tf:.1f} | "
              f"{1000 * tc:.2f} | {ended} / {valid} / {total} |")
    print("(complete: the JSON ended within max_tokens; valid: those that parse and validate; the others "
          "reached max_tokens first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
