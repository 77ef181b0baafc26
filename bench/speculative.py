"""Speculative decoding at batch 1 on smollm-135m-shape, with prompt lookup
(SpeculativeConfig(method="ngram"), the default) or a draft model (--method draft_model: the
model's first --draft-layers layers, embedding and head, a layer-skipping draft built once
beside the model): decode tokens/s with and without it, measured alternately in the same
run (median of --runs), with the draft acceptance and the outputs compared. Three workloads,
each one request of a 128-token prompt and 128 generated tokens:

- repeating: W2's request, greedy. This random-weight model's greedy output falls into a
  repetition within a few tokens, which prompt lookup predicts (the best case: outputs that
  restate their input or themselves).
- no match: W2's request sampled at temperature 1 (seeded): the output does not repeat,
  lookup finds nothing, no draft is proposed (what speculation costs when it has nothing).
- wrong drafts: W2's request sampled at temperature 1, every step carrying k drafts that
  are all rejected (set through the batch manager's set_draft_tokens, as a draft model
  would: k copies of a token the sample almost never is): the worst case, what a step's k
  rejected drafts cost. (Prompt lookup only: a draft model proposes its own.)

--model copying runs copying-135m-shape instead (the same shape, weights built to copy their
context: bench/common.copying_checkpoint) on one workload, copying: a prompt of BOS, a span
of 96 distinct tokens and its first 32 again (129 tokens), greedy; the model continues the
span (checked), which both prompt lookup and a draft of its first 2 layers predict.

--unrelated-draft (draft_model, smollm): the draft is copying-135m-shape's first 2 layers,
whose proposals have nothing to do with the model's: what a useless draft costs.
--fixed-k turns the adaptive draft length off (every step carries k drafts, less the back-off).

Greedy outputs must be equal with and without speculation; sampled ones are equal with prompt
lookup, and with a draft model only in distribution (its rejection rule draws differently).

    python bench/speculative.py                  # float32, k = 4
    python bench/speculative.py --dtype bfloat16 --k 4 --runs 3
    python bench/speculative.py --method draft_model --draft-layers 1 --k 3
    python bench/speculative.py --method draft_model --draft-layers 0 --draft-quantization q4_0 --k 4
    python bench/speculative.py --model copying [--method draft_model --draft-layers 2]
    python bench/speculative.py --method draft_model --unrelated-draft
    python bench/speculative.py --device cuda --model copying   # on a GPU (CUDA graphs on)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import (BENCH_THREADS, SMOLLM_VOCAB, copying_checkpoint, machine_info, median,  # noqa: E402
                          set_threads, smollm_checkpoint, w2_request)

COPYING_SPAN, COPYING_REPEAT = 96, 32


def workloads(method: str, model: str) -> list[tuple[str, list[int], float, bool]]:
    """(name, prompt, temperature, forced wrong drafts)."""
    if model == "copying":
        from pyengine.testing.copying_model import copying_prompt

        return [("copying (greedy)", copying_prompt(COPYING_SPAN, COPYING_REPEAT).token_ids, 0.0, False)]
    w2 = w2_request().prompt_token_ids
    if method == "draft_model":
        return [("repeating (greedy)", w2, 0.0, False), ("sampled (T=1)", w2, 1.0, False)]
    return [("repeating (greedy)", w2, 0.0, False), ("no match (T=1)", w2, 1.0, False),
            ("wrong drafts (T=1)", w2, 1.0, True)]


def draft_checkpoint(model_dir: Path, num_layers: int) -> Path:
    """The model's first `num_layers` layers as a draft model, built once beside it."""
    from pyengine.testing.checkpoints import build_truncated_checkpoint

    path = model_dir.parent / f"{model_dir.name}-first{num_layers}"
    if not (path / "config.json").is_file():
        build_truncated_checkpoint(model_dir, path, num_layers)
    return path


def decode_rate(engine, prompt: list[int], temperature: float, new_tokens: int, wrong_drafts: bool = False):
    """Decode tokens/s after the first token, and the final output."""
    from pyengine import SamplingParams

    params = SamplingParams(temperature=temperature, seed=1, max_tokens=new_tokens, ignore_eos=True)
    k = engine.config.speculative_config.num_speculative_tokens if wrong_drafts else 0
    request_id = engine.add_request(prompt, params)
    core_id = engine._requests.core_id(request_id)
    first = last = None
    while engine.has_unfinished_requests():
        if k and last is not None and not last.finished:
            engine._bm.set_draft_tokens(core_id, [SMOLLM_VOCAB - 1] * k)
        for out in engine.step():
            if first is None:
                first = time.perf_counter()
            last = out
    return (new_tokens - 1) / (time.perf_counter() - first), last


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--method", choices=["ngram", "draft_model"], default="ngram")
    p.add_argument("--draft-layers", type=int, default=1,
                   help="draft_model: the model layers the draft keeps (0: all, the model itself)")
    p.add_argument("--draft-quantization", default=None,
                   help="draft_model: quantize the draft at load (e.g. q4_0; float32 only)")
    p.add_argument("--model", choices=["smollm", "copying"], default="smollm")
    p.add_argument("--unrelated-draft", action="store_true",
                   help="draft_model: copying-135m-shape's first 2 layers as the draft (smollm only)")
    p.add_argument("--fixed-k", action="store_true", help="adaptive_draft_length=False")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (CUDA graphs on: decode and verify batches)")
    args = p.parse_args(argv)
    set_threads(BENCH_THREADS)
    from pyengine import Engine, KvCacheConfig, SchedulerConfig, SpeculativeConfig

    if args.unrelated_draft and (args.method != "draft_model" or args.model != "smollm"):
        p.error("--unrelated-draft is for --method draft_model on --model smollm")
    model_dir = copying_checkpoint() if args.model == "copying" else smollm_checkpoint()
    model_name = "copying-135m-shape" if args.model == "copying" else "smollm-135m-shape"

    def engine(spec):
        return Engine(model_dir, dtype=args.dtype, max_seq_len=512, speculative_config=spec, device=args.device,
                      kv_cache_config=KvCacheConfig(max_tokens=2048, enable_block_reuse=False),
                      scheduler_config=SchedulerConfig(max_batch_size=4, max_num_tokens=512))

    adaptive = not args.fixed_k
    if args.method == "draft_model":
        if args.unrelated_draft:
            draft = draft_checkpoint(copying_checkpoint(), 2)
            source = "draft model: copying-135m-shape's first 2 layers (unrelated)"
        else:
            draft = draft_checkpoint(model_dir, args.draft_layers) if args.draft_layers else model_dir
            source = (f"draft model: the first {args.draft_layers} layer(s)" if args.draft_layers
                      else "draft model: the model itself")
        config = SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=args.k,
                                   draft_quantization=args.draft_quantization, adaptive_draft_length=adaptive)
        if args.draft_quantization:
            source += f", quantized to {args.draft_quantization}"
    else:
        config = SpeculativeConfig(num_speculative_tokens=args.k, adaptive_draft_length=adaptive)
        source = "prompt lookup"
    source += ", adaptive draft length" if adaptive else ", fixed k"
    plain, spec = engine(None), engine(config)
    where = (f"{machine_info()['cpu']}, {BENCH_THREADS} threads" if args.device == "cpu"
             else f"{torch.cuda.get_device_name(args.device)}")
    print(f"Speculative decoding ({source}, k={args.k}), batch 1, {model_name} {args.dtype}, {where}; "
          f"median of {args.runs}")
    if adaptive:
        print(f"adaptive draft length costs: {spec.startup_report()['adaptive_draft_length']}")
    print("| workload | without tok/s | with tok/s | ratio | drafts accepted / verified | outputs equal |")
    print("|---|---|---|---|---|---|")
    for name, prompt, temperature, wrong in workloads(args.method, args.model):
        decode_rate(plain, prompt, temperature, args.new_tokens)  # warm-up
        decode_rate(spec, prompt, temperature, args.new_tokens, wrong)
        a, b = [], []
        for _ in range(args.runs):  # alternating, so that a slow phase of the machine hits both
            a.append(decode_rate(plain, prompt, temperature, args.new_tokens))
            b.append(decode_rate(spec, prompt, temperature, args.new_tokens, wrong))
        ra, rb = median([x[0] for x in a]), median([x[0] for x in b])
        m = b[-1][1].metrics
        equal = all(x[1].token_ids == y[1].token_ids for x, y in zip(a, b))
        if args.model == "copying":  # the model must copy, or the workload is not one
            from pyengine.testing.copying_model import copying_prompt

            expected = copying_prompt(COPYING_SPAN, COPYING_REPEAT).continuation(args.new_tokens)
            equal = equal and b[-1][1].token_ids == expected
        print(f"| {name} | {ra:.1f} | {rb:.1f} | {rb / ra:.2f}x | {m.num_accepted_draft_tokens} / "
              f"{m.num_draft_tokens} | {'yes' if equal else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
