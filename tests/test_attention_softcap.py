"""Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``) in paged_attention: the CPU
kernels at every instruction-set level against a dense PyTorch reference that caps the scores as
Hugging Face's Gemma2 does (``scores * scale``, ``/ softcap``, ``tanh``, ``* softcap``, then the
mask and the softmax), and the argument checks of the CPU and CUDA front ends."""

from __future__ import annotations

import re

import pytest
import torch

import pyengine.core._core as _core
from paged_kv import make_paged_kv, ref_attention
from pyengine.layers import _attention_cuda
from pyengine.layers.attention import paged_attention
from pyengine.layers.cpu_features import set_cpu_isa

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# as tests/test_kernels.py: fp32 differs from the fp64 reference by fp32 accumulation only
# (the kernel's tanh is within ~1e-6 of tanh, its exp within ~1e-6 of exp); fp16 / bf16 by
# their output rounding
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=8e-3, rtol=8e-3)}

# decode rows, a prefill chunk after earlier KV, a full prefill, a one-token sequence, a sequence
# with no query rows this step, a short chunk deep into a context
MIXED = [(300, 1), (200, 40), (57, 57), (1, 1), (90, 0), (700, 3)]

# (num_heads, num_kv_heads, head_dim, tokens_per_block): MHA, GQA 4 with head_dim 80, MQA with
# 5-token blocks
SHAPES = [(4, 4, 64, 16), (8, 2, 80, 16), (8, 1, 64, 5)]


def run(specs, shape, dtype, window, softcap, seed, q_mult=1.0, cache_dtype=None):
    """paged_attention with `softcap` on a random paged batch; returns (kernel output, fp64
    reference with the same cap, the inputs)."""
    num_heads, num_kv_heads, head_dim, tpb = shape
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    k_cache, v_cache, qsl, seq_lens, bt, kvs = make_paged_kv(
        specs, num_kv_heads, head_dim, tpb, cache_dtype, gen, window, free_out_of_window=window > 0)
    num_tokens = sum(q for _, q in specs)
    query = (torch.randn(num_tokens, num_heads, head_dim, generator=gen) * q_mult).to(dtype)
    scale = head_dim ** -0.5
    out = paged_attention(query, k_cache, v_cache, qsl, seq_lens, bt, scale, window, softcap=softcap)
    assert out.dtype == dtype and out.shape == query.shape
    ref = ref_attention(query, kvs, specs, scale, window, softcap=softcap)
    inputs = dict(query=query, k_cache=k_cache, v_cache=v_cache, query_start_loc=qsl, seq_lens=seq_lens,
                  block_tables=bt, scale=scale, sliding_window=window)
    return out, ref, inputs


# scores here are about N(0, 1): a cap of 1 bends most of them (tanh's exponential form), one of
# 30 only the largest a little (its Taylor form)
@pytest.mark.parametrize("softcap", [1.0, 30.0])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h%d_kv%d_d%d_t%d" % s)
def test_softcap_matches_the_capped_reference(shape, dtype, window, softcap, cpu_isa):
    seed = sum(map(ord, f"{shape}{dtype}{window}{softcap}"))
    out, ref, _ = run(MIXED, shape, DTYPES[dtype], window, softcap, seed)
    torch.testing.assert_close(out.double(), ref, **TOL[DTYPES[dtype]])


def test_fp32_query_on_a_bf16_cache(cpu_isa):
    out, ref, _ = run(MIXED, (8, 2, 64, 16), torch.float32, 0, 2.0, 3, cache_dtype=torch.bfloat16)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


def test_saturated_scores(cpu_isa):
    # queries 8x larger: most scores are far beyond the cap of 5, where tanh is flat
    out, ref, _ = run(MIXED, (8, 2, 64, 16), torch.float32, 0, 5.0, 4, q_mult=8.0)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


@pytest.mark.parametrize("window", [0, 300])
def test_softcap_in_the_split_k_path(window, cpu_isa):
    # few work items with long contexts: split-K pieces, merged (the running max is capped)
    out, ref, _ = run([(4000, 1), (1000, 1)], (4, 1, 128, 16), torch.float32, window, 2.0, 5)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


def test_softcap_changes_the_result(cpu_isa):
    """A kernel that ignored the cap would pass none of the tests above: the capped output is far
    from the uncapped one, and from the uncapped reference."""
    capped, ref, inputs = run(MIXED, (8, 2, 64, 16), torch.float32, 0, 1.0, 6)
    plain = paged_attention(**inputs)
    uncapped_ref = ref_attention(inputs["query"], *_kvs_of(inputs), inputs["scale"], 0)
    torch.testing.assert_close(plain.double(), uncapped_ref, **TOL[torch.float32])
    assert (capped - plain).abs().max() > 0.05
    assert (capped.double() - uncapped_ref).abs().max() > 0.05
    torch.testing.assert_close(capped.double(), ref, **TOL[torch.float32])


def _kvs_of(inputs):
    """(per-sequence KV, specs) read back from a paged cache (for a second reference)."""
    k_cache, v_cache, bt = inputs["k_cache"], inputs["v_cache"], inputs["block_tables"]
    qsl, lens = inputs["query_start_loc"].tolist(), inputs["seq_lens"].tolist()
    tpb = k_cache.shape[2]
    kvs, specs = [], []
    for i, L in enumerate(lens):
        pos = torch.arange(L)
        bid = bt[i].long()[pos // tpb]
        kvs.append((k_cache[bid, :, pos % tpb], v_cache[bid, :, pos % tpb]))
        specs.append((L, qsl[i + 1] - qsl[i]))
    return kvs, specs


def test_zero_softcap_is_the_uncapped_kernel(cpu_isa):
    _, _, inputs = run(MIXED, (8, 2, 64, 16), torch.bfloat16, 37, 1.0, 7)
    assert torch.equal(paged_attention(**inputs, softcap=0.0), paged_attention(**inputs))


def test_every_level_caps_the_same():
    """Each instruction-set level's back end against the portable one, with the cap: the same
    result up to the order of fp32 additions."""
    previous = _core._cpu_isa()
    outs = {}
    try:
        for level in _core._supported_cpu_isas():
            set_cpu_isa(level)
            outs[level], ref, _ = run(MIXED, (8, 2, 80, 16), torch.float32, 0, 1.5, 8)
            torch.testing.assert_close(outs[level].double(), ref, **TOL[torch.float32])
    finally:
        set_cpu_isa(previous)
    for level, out in outs.items():
        torch.testing.assert_close(out, outs["generic"], atol=1e-5, rtol=1e-5)


BAD_SOFTCAPS = [-1.0, -1e-9, float("nan"), float("inf"), float("-inf"), 1e39, 1e-45, "3", None, True]


@pytest.mark.parametrize("bad", BAD_SOFTCAPS, ids=repr)
def test_bad_softcap_raises_naming_the_value(bad):
    _, _, inputs = run([(20, 1), (10, 4)], (4, 2, 32, 8), torch.float32, 0, 1.0, 9)
    out = torch.full_like(inputs["query"], 7.0)
    with pytest.raises(ValueError, match=rf"^softcap: .*{re.escape(repr(bad))}"):
        paged_attention(**inputs, out=out, softcap=bad)
    assert torch.all(out == 7.0)  # refused before anything ran
    # the CUDA front end checks it first too (here, before it looks at the tensors' device)
    with pytest.raises(ValueError, match=rf"^softcap: .*{re.escape(repr(bad))}"):
        _attention_cuda.paged_attention(**inputs, max_query_len=4, max_context_len=20,
                                        workspace=torch.empty(0, dtype=torch.uint8), softcap=bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_the_core_binding_refuses_a_bad_softcap(bad):
    _, _, a = run([(20, 1), (10, 4)], (4, 2, 32, 8), torch.float32, 0, 1.0, 10)
    q, kc = a["query"], a["k_cache"]
    out = torch.full_like(q, 7.0)
    args = (out.data_ptr(), 128, q.data_ptr(), 128, 0, kc.data_ptr(), a["v_cache"].data_ptr(), 0,
            a["query_start_loc"].data_ptr(), a["seq_lens"].data_ptr(), a["block_tables"].data_ptr(), 2, 5,
            a["block_tables"].shape[1], 4, 2, 32, 8, kc.shape[0], a["scale"], 0, 1)
    with pytest.raises(ValueError, match=r"^softcap: must be finite and >= 0 \(0 disables it\), got"):
        _core._paged_attention(*args, softcap=bad)
    assert torch.all(out == 7.0)
    _core._paged_attention(*args, softcap=1.0)
    ref = ref_attention(q, *_kvs_of(a), a["scale"], 0, softcap=1.0)
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])
