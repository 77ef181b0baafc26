"""The hand-built copying Llama (pyengine/testing/copying_model.py): with transformers as the
reference, greedy decoding continues a repeated span exactly (float32 and bfloat16, small
and benchmark shapes, prompts up to 513 tokens), with a top1 - top2 logit gap of at least
18.5 on every copied position (23 at the benchmark shape); its first two layers alone give
the same logits; the engine generates the same tokens, also with speculative decoding."""

from __future__ import annotations

import json
from functools import lru_cache

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

from hf_reference import hf_greedy, hf_model
from pyengine import Engine, SamplingParams, SpeculativeConfig
from pyengine.testing.checkpoints import build_truncated_checkpoint, checkpoint_digest
from pyengine.testing.copying_model import (BOS_TOKEN_ID, OUTPUT_LOGIT, build_copying_checkpoint,
                                            copying_prompt, copying_rope_theta)

SMALL = dict(num_layers=4, hidden_size=256, intermediate_size=512, vocab_size=4096, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
#: (span length, repeat, seed, new tokens): short and long spans, a repeat of one token, a
#: repeat longer than the span (it cycles), and continuations that wrap around to the span's start.
CASES = [(64, 16, 0, 64), (32, 5, 1, 48), (100, 1, 2, 40), (16, 40, 3, 24), (200, 120, 4, 32)]
#: A span of 256 distinct tokens repeated whole: a 513-token prompt.
LONG = (256, 256, 11)
#: The smallest top1 - top2 logit gap asserted on copied positions: the small shape's codes
#: guarantee OUTPUT_LOGIT x (1 - 0.532) = 18.7 (module docstring), less bf16 rounding.
SMALL_MIN_GAP = 18.5
#: The benchmark shape's: 40 x (1 - 0.417) = 23.3.
FULL_MIN_GAP = 23.0


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """This module runs many small forwards (transformers' and the engine's, both sized by
    torch's thread count), whose time is mostly thread synchronisation: with two threads it
    grows ~50x when another process keeps the cores busy, with one it does not."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def small_dir(request, tmp_path_factory):
    return build_copying_checkpoint(tmp_path_factory.mktemp("copying") / "model", dtype=request.param, **SMALL)


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    return build_copying_checkpoint(tmp_path_factory.mktemp("copying_fp32") / "model", **SMALL)


@pytest.fixture(scope="module")
def draft_dir(fp32_dir, tmp_path_factory):
    return build_truncated_checkpoint(fp32_dir, tmp_path_factory.mktemp("copying_draft") / "model", 2)


def dtype_of(model_dir) -> torch.dtype:
    return getattr(torch, json.loads((model_dir / "config.json").read_text())["dtype"])


def small_prompt(span: int, repeat: int, seed: int):
    return copying_prompt(span, repeat, vocab_size=SMALL["vocab_size"], seed=seed)


@lru_cache(maxsize=None)
def hf_tokens(model_dir, span: int, repeat: int, seed: int, new_tokens: int) -> list[int]:
    """transformers' greedy continuation of small_prompt(span, repeat, seed), computed once."""
    return hf_greedy(model_dir, small_prompt(span, repeat, seed).token_ids, new_tokens, dtype=dtype_of(model_dir))


@torch.inference_mode()
def copied_gaps(model, cp, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced over prompt + continuation: (whether the argmax is the next token, the
    top1 - top2 logit gap) at every position from the first repeated token on (all copied)."""
    ids = cp.token_ids + cp.continuation(new_tokens)
    logits = model(torch.tensor([ids])).logits[0].float()
    first = 1 + len(cp.span)  # BOS + span: the first repeated token
    top2 = logits[first:-1].topk(2, dim=-1)
    right = top2.indices[:, 0] == torch.tensor(ids[first + 1:])
    return right, top2.values[:, 0] - top2.values[:, 1]


@pytest.mark.parametrize("span,repeat,seed,new", CASES)
def test_transformers_greedy_copies_the_span(small_dir, span, repeat, seed, new):
    assert hf_tokens(small_dir, span, repeat, seed, new) == small_prompt(span, repeat, seed).continuation(new)


def test_the_continuation_wraps_and_is_no_repetition_of_the_last_token(small_dir):
    cp = small_prompt(24, 8, 7)
    out = hf_greedy(small_dir, cp.token_ids, 60, dtype=dtype_of(small_dir))
    assert out == cp.span[8:] + cp.span + cp.span[:20]
    assert out[0] != cp.token_ids[-1]
    # Each generated token differs from the one before it (the input at that step), and all 24 occur.
    assert all(a != b for a, b in zip([cp.token_ids[-1]] + out, out))
    assert len(set(out)) == 24


def test_copied_positions_have_a_large_logit_gap(small_dir):
    dtype = dtype_of(small_dir)
    for span, repeat, seed, new in CASES:
        right, gaps = copied_gaps(hf_model(str(small_dir), dtype), small_prompt(span, repeat, seed), new)
        assert right.all()
        assert gaps.min().item() >= SMALL_MIN_GAP, (span, repeat, seed, gaps.min().item())


def test_the_gap_bound_follows_from_the_codes(fp32_dir):
    """The head's rows are OUTPUT_LOGIT-scaled token codes: the largest cosine between two of them
    bounds the gap from below (0.532 at the small shape: >= 18.7)."""
    model = LlamaForCausalLM.from_pretrained(str(fp32_dir), dtype=torch.float32)
    codes = torch.nn.functional.normalize(model.lm_head.weight.detach(), dim=-1)
    cos = codes @ codes.T
    cos.fill_diagonal_(-1.0)
    assert OUTPUT_LOGIT * (1 - cos.max().item()) >= 18.5


def test_long_context(small_dir):
    """A span of 256 distinct tokens repeated: 513-token prompt, 64 tokens copied."""
    cp = small_prompt(*LONG)
    assert hf_tokens(small_dir, *LONG, 64) == cp.continuation(64)
    right, gaps = copied_gaps(hf_model(str(small_dir), dtype_of(small_dir)), cp, 64)
    assert right.all() and gaps.min().item() >= SMALL_MIN_GAP


def test_two_layers_give_the_same_logits(fp32_dir, draft_dir):
    """Layers 2.. leave the residual unchanged: the truncated model (the draft) is the same model."""
    cp = small_prompt(64, 16, 0)
    ids = torch.tensor([cp.token_ids + cp.continuation(16)])
    with torch.inference_mode():
        full = LlamaForCausalLM.from_pretrained(str(fp32_dir)).eval()(ids).logits
        draft = LlamaForCausalLM.from_pretrained(str(draft_dir)).eval()(ids).logits
    assert torch.equal(full, draft)


def test_benchmark_shape(tmp_path):
    """The default shape (30 layers, hidden 576, 9/3 heads, vocabulary 32000), float32."""
    model_dir = build_copying_checkpoint(tmp_path / "model")
    cfg = json.loads((model_dir / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 32000)
    assert copying_rope_theta(64, 2048) == 1e11
    # Loaded here, not through hf_model: its cache would keep the 0.5 GB model for the session.
    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cp = copying_prompt(64, 16, seed=5)
    ids = torch.tensor([cp.token_ids])
    greedy = GenerationConfig(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
    assert out[0, len(cp.token_ids):].tolist() == cp.continuation(24)
    right, gaps = copied_gaps(model, copying_prompt(256, 256, seed=6), 16)
    assert right.all() and gaps.min().item() >= FULL_MIN_GAP


def test_engine_matches_transformers(small_dir):
    dtype = dtype_of(small_dir)
    engine = Engine(small_dir, dtype="bfloat16" if dtype == torch.bfloat16 else "float32", max_seq_len=1024, seed=0)
    cases = CASES + [(*LONG, 64)]
    outs = engine.generate([small_prompt(s, r, seed).token_ids for s, r, seed, _ in cases],
                           [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for *_, n in cases],
                           use_tqdm=False)
    for (s, r, seed, n), out in zip(cases, outs):
        assert out.token_ids == hf_tokens(small_dir, s, r, seed, n) == small_prompt(s, r, seed).continuation(n)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_engine_speculative_decoding_copies(fp32_dir, draft_dir, method):
    """The workload the model is for: prompt lookup and the 2-layer draft propose the span and
    the model accepts (the draft is the same model: every draft is accepted)."""
    spec = (SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
            if method == "ngram" else
            SpeculativeConfig(method="draft_model", draft_model=draft_dir, num_speculative_tokens=4))
    engine = Engine(fp32_dir, max_seq_len=512, seed=0, speculative_config=spec)
    cps = [small_prompt(64, 16, 0), small_prompt(100, 30, 1)]
    outs = engine.generate([cp.token_ids for cp in cps],
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for cp, out in zip(cps, outs):
        assert out.token_ids == cp.continuation(40)
        rate = out.metrics.draft_acceptance_rate
        assert rate is not None and rate >= (1.0 if method == "draft_model" else 0.9), rate


def test_deterministic_per_seed(tmp_path, fp32_dir):
    again = build_copying_checkpoint(tmp_path / "again", **SMALL)
    other = build_copying_checkpoint(tmp_path / "other", seed=1, **SMALL)
    assert checkpoint_digest(again) == checkpoint_digest(fp32_dir)
    assert checkpoint_digest(other) != checkpoint_digest(fp32_dir)


def test_copying_prompt():
    cp = copying_prompt(64, 16, vocab_size=4096, seed=3)
    assert cp.token_ids[0] == BOS_TOKEN_ID and len(cp.token_ids) == 1 + 64 + 16
    assert len(set(cp.span)) == 64 and min(cp.span) >= 3 and max(cp.span) < 4096
    assert cp.token_ids[1:] == cp.span + cp.span[:16]
    assert cp.continuation(50) == cp.span[16:] + cp.span[:2]
    assert copying_prompt(64, 16, vocab_size=4096, seed=3) == cp
    assert copying_prompt(8, 3, bos=False, seed=0).token_ids == copying_prompt(8, 3, seed=0).token_ids[1:]
    with pytest.raises(ValueError, match=r"repeat must be >= 1 \(the model copies only what recurs\), got 0"):
        copying_prompt(8, 0)


@pytest.mark.parametrize("shape, message", [
    (dict(num_layers=1), "the copying circuit needs num_layers >= 2, got 1"),
    (dict(hidden_size=256, num_attention_heads=8), "the copying model needs an even head_dim >= 64, got 32"),
    (dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2),
     "hidden_size=128 is too small for 2 KV heads: the circuit needs 1 \\+ 192 dims"),
    (dict(vocab_size=70000), "vocab_size=70000 is larger than the 65536 codes available")])
def test_rejects_shapes_the_circuit_does_not_fit(tmp_path, shape, message):
    """One layer; head_dim 32; no room in the residual for the subspaces; more tokens than codes."""
    kwargs = dict(SMALL, **shape)
    with pytest.raises(ValueError, match=message):
        build_copying_checkpoint(tmp_path / "model", **kwargs)
