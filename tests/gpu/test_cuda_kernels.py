"""The CUDA kernels (pyengine.layers._attention_cuda) against PyTorch references; needs a GPU.

Every case builds a paged cache in shuffled blocks whose unused slots hold NaN (fp8: the e4m3
NaN), so a stray read of a slot outside a sequence shows up as NaN. The reference is attention
per sequence in fp32 (fp64 for fp32 activations) over the K/V values *as stored* (fp8:
dequantized).
"""

from __future__ import annotations

import pytest
import torch

import pyengine.core._core as _core
from paged_kv import FP8, make_paged_kv, raw, ref_attention

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        not _core._cuda_kernels_built(), reason="pyengine was built without its CUDA kernels"
    ),
]

if torch.cuda.is_available() and _core._cuda_kernels_built():
    from pyengine.layers import _attention_cuda as ck

DEV = "cuda"
TOL = {torch.float32: 2e-4, torch.bfloat16: 2.5e-2, torch.float16: 4e-3}


def make_batch(specs, num_heads, num_kv_heads, head_dim, tokens_per_block, dtype, cache_dtype,
               gen, window=0, k_scale=1.0, v_scale=1.0):
    """specs: list of (seq_len, q_len). Returns (the kernel's inputs as a dict, per-sequence
    (k, v) as stored)."""
    k_cache, v_cache, qsl, seq_lens, block_tables, kvs = make_paged_kv(
        specs, num_kv_heads, head_dim, tokens_per_block, cache_dtype, gen, window,
        free_out_of_window=True, device=DEV, k_scale=k_scale, v_scale=v_scale)
    num_tokens = sum(q for _, q in specs)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEV).to(dtype)
    inputs = dict(query=query, k_cache=k_cache, v_cache=v_cache, query_start_loc=qsl,
                  seq_lens=seq_lens, block_tables=block_tables)
    return inputs, kvs


def reference(query, kvs, specs, scale, window, softcap=0.0):
    """fp64 for fp32 activations, fp32 otherwise (long contexts), returned in fp32."""
    acc = torch.float64 if query.dtype == torch.float32 else torch.float32
    return ref_attention(query, kvs, specs, scale, window, acc, softcap=softcap).float()


def run_case(specs, num_heads, num_kv_heads, head_dim, tokens_per_block, dtype,
             cache_dtype=None, window=0, k_scale=1.0, v_scale=1.0, max_context_len=None,
             seed=0, softcap=0.0, q_mult=1.0):
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    gen = torch.Generator().manual_seed(seed)
    inputs, kvs = make_batch(specs, num_heads, num_kv_heads, head_dim, tokens_per_block, dtype,
                             cache_dtype, gen, window, k_scale, v_scale)
    if q_mult != 1.0:
        inputs["query"] = (inputs["query"].float() * q_mult).to(dtype)
    scale = head_dim ** -0.5
    max_query_len = max(q for _, q in specs)
    max_ctx = max(L for L, _ in specs) if max_context_len is None else max_context_len
    num_tokens = inputs["query"].shape[0]
    ws = ck.paged_attention_workspace(num_tokens, num_heads, head_dim, max_ctx, DEV)
    out = ck.paged_attention(**inputs, scale=scale, sliding_window=window,
                             max_query_len=max_query_len, max_context_len=max_ctx, workspace=ws,
                             k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    ref = reference(inputs["query"], kvs, specs, scale, window, softcap)
    assert out.dtype == dtype
    assert torch.isfinite(out.float()).all(), "NaN/inf in the output (a stray cache read?)"
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    return out, ref


# ---- decode (max_query_len == 1): flash-decoding, split-K ----

DECODE_CASES = [
    # (seq_lens, heads, kv_heads, head_dim, tokens_per_block, dtype)
    ([1, 17, 300, 4096], 16, 8, 128, 16, torch.bfloat16),
    ([5, 1000, 2049], 8, 8, 128, 32, torch.float16),
    ([33, 700], 16, 4, 64, 16, torch.bfloat16),
    ([129, 2500], 32, 4, 256, 16, torch.bfloat16),
    ([64, 1500], 16, 1, 128, 32, torch.float16),  # MQA: two head chunks of 8
    ([3, 999], 8, 2, 256, 16, torch.float16),
    ([1, 31, 2000], 16, 8, 128, 16, torch.float32),
    ([2, 700], 8, 1, 64, 32, torch.float32),
    ([300, 900], 4, 4, 256, 16, torch.float32),
]


@pytest.mark.parametrize("lens, nh, nkv, hd, tpb, dtype", DECODE_CASES)
def test_decode(lens, nh, nkv, hd, tpb, dtype):
    run_case([(L, 1) for L in lens], nh, nkv, hd, tpb, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_long_context_splits(dtype):
    # one 32k row (many splits) next to short rows whose later splits are empty
    run_case([(32768, 1), (1, 1), (300, 1)], 16, 8, 128, 16, dtype)


def test_decode_graph_sized_grid():
    # max_context_len far above the real lengths (a CUDA graph's bound): same results
    run_case([(10, 1), (1234, 1)], 16, 8, 128, 16, torch.bfloat16, max_context_len=16384)


def test_decode_skips_empty_sequences():
    # max_query_len 1 with sequences that have no query row this step
    run_case([(40, 1), (77, 0), (500, 1), (3, 0)], 8, 4, 64, 16, torch.float16)


# ---- prefill (max_query_len > 1): tensor cores for bf16/fp16 hd 64/128, SIMT otherwise ----

PREFILL_SPECS = [(1000, 1000), (3000, 512), (57, 1), (1, 1), (130, 0), (300, 77)]


@pytest.mark.parametrize(
    "nh, nkv, hd, tpb, dtype",
    [
        (16, 8, 128, 16, torch.bfloat16),
        (16, 16, 64, 32, torch.float16),
        (32, 4, 128, 32, torch.float16),
        (8, 1, 64, 16, torch.bfloat16),
        (16, 4, 256, 16, torch.bfloat16),  # head_dim 256: the SIMT path
        (8, 2, 128, 16, torch.float32),  # fp32: the SIMT path
        (4, 4, 64, 32, torch.float32),
    ],
)
def test_prefill_mixed(nh, nkv, hd, tpb, dtype):
    run_case(PREFILL_SPECS, nh, nkv, hd, tpb, dtype)


def test_prefill_single_long_chunk():
    run_case([(4096, 1024)], 16, 8, 128, 16, torch.bfloat16)


# ---- sliding window (out-of-window blocks freed: table entries -1) ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decode", [True, False])
def test_sliding_window(dtype, decode):
    specs = [(5000, 1), (70, 1), (1, 1)] if decode else [(2000, 300), (90, 90), (700, 1)]
    run_case(specs, 16, 4, 128, 16, dtype, window=100)


# ---- fp8 e4m3 cache ----

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("hd", [64, 128])
def test_fp8_cache(dtype, decode, hd):
    specs = [(3000, 1), (20, 1), (600, 1)] if decode else [(1500, 400), (33, 1), (200, 200)]
    run_case(specs, 16, 8, hd, 16, dtype, cache_dtype=FP8, k_scale=0.05, v_scale=0.02)


def test_fp8_cache_decode_hd256():
    run_case([(2000, 1), (5, 1)], 8, 2, 256, 32, torch.bfloat16, cache_dtype=FP8, k_scale=0.1,
             v_scale=0.1)


# ---- logit soft-capping (Gemma 2): softcap * tanh(scale * q.k / softcap) before the mask ----
# Scores here are about N(0, 1) (x3 with q_mult=3): a cap of 1-5 bends most of them.

@pytest.mark.parametrize(
    "nh, nkv, hd, tpb, dtype",
    [
        (16, 8, 128, 16, torch.bfloat16),
        (8, 8, 64, 32, torch.float16),
        (16, 4, 256, 16, torch.bfloat16),  # head_dim 256: the SIMT kernel for prefill too
        (8, 2, 128, 16, torch.float32),  # fp32: the SIMT kernel
    ],
)
@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("window", [0, 100])
def test_softcap(nh, nkv, hd, tpb, dtype, decode, window):
    specs = [(3000, 1), (20, 1), (600, 1), (1, 1)] if decode else PREFILL_SPECS
    run_case(specs, nh, nkv, hd, tpb, dtype, window=window, softcap=2.0, seed=7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_softcap_saturated_long_context_splits(dtype):
    # scores far beyond the cap, one 32k row split many ways next to short rows
    run_case([(32768, 1), (1, 1), (300, 1)], 16, 8, 128, 16, dtype, softcap=5.0, q_mult=3.0, seed=8)


@pytest.mark.parametrize("decode", [True, False])
def test_softcap_fp8_cache(decode):
    # the k_scale is applied before the cap (softcap * tanh(scale * k_scale * q.k_stored / softcap))
    specs = [(3000, 1), (20, 1)] if decode else [(1500, 400), (33, 1)]
    run_case(specs, 16, 8, 128, 16, torch.bfloat16, cache_dtype=FP8, k_scale=0.05, v_scale=0.02,
             softcap=1.5, seed=9)


@pytest.mark.parametrize("decode", [True, False])
def test_softcap_changes_the_result(decode):
    """Both kernels with and without the cap: far apart (a kernel that ignored the cap would fail
    the tests above against the capped reference)."""
    specs = [(700, 1), (90, 1)] if decode else [(700, 200), (90, 90)]
    capped, _ = run_case(specs, 16, 8, 128, 16, torch.bfloat16, softcap=1.0, seed=10)
    plain, _ = run_case(specs, 16, 8, 128, 16, torch.bfloat16, seed=10)
    assert (capped.float() - plain.float()).abs().max() > 0.1


# ---- layouts ----

def test_strided_query_and_out():
    gen = torch.Generator().manual_seed(3)
    specs = [(500, 100), (40, 1)]
    nh, nkv, hd = 8, 4, 128
    inputs, kvs = make_batch(specs, nh, nkv, hd, 16, torch.bfloat16, torch.bfloat16, gen)
    q = inputs["query"]
    fused = torch.zeros(q.shape[0], nh + 2 * nkv, hd, dtype=q.dtype, device=DEV)
    fused[:, :nh] = q
    inputs["query"] = fused[:, :nh]  # row stride (nh + 2 nkv) * hd
    out_buf = torch.zeros(q.shape[0], nh + 1, hd, dtype=q.dtype, device=DEV)
    ws = ck.paged_attention_workspace(q.shape[0], nh, hd, 500, DEV)
    out = ck.paged_attention(**inputs, scale=hd ** -0.5, max_query_len=100, max_context_len=500,
                             workspace=ws, out=out_buf[:, 1:])
    ref = reference(q, kvs, specs, hd ** -0.5, 0)
    torch.testing.assert_close(out.float(), ref, atol=2.5e-2, rtol=2.5e-2)
    assert (out_buf[:, 0] == 0).all()


def test_cuda_graph_replay():
    gen = torch.Generator().manual_seed(4)
    specs = [(100, 1), (2000, 1)]
    inputs, kvs = make_batch(specs, 16, 8, 128, 16, torch.bfloat16, torch.bfloat16, gen)
    ws = ck.paged_attention_workspace(2, 16, 128, 4096, DEV)
    out = torch.empty_like(inputs["query"])
    kw = dict(scale=128 ** -0.5, max_query_len=1, max_context_len=4096, workspace=ws, out=out)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ck.paged_attention(**inputs, **kw)  # warm-up (kernel attributes) outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ck.paged_attention(**inputs, **kw)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(inputs["query"], kvs, specs, 128 ** -0.5, 0)
    torch.testing.assert_close(out.float(), ref, atol=2.5e-2, rtol=2.5e-2)


# ---- store_kv ----

@pytest.mark.parametrize(
    "src, cache",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, FP8),
        (torch.float16, FP8),
    ],
)
@pytest.mark.parametrize("tpb", [16, 32])
def test_store_kv(src, cache, tpb):
    gen = torch.Generator().manual_seed(5)
    nkv, hd, num_blocks, n = 4, 128, 12, 50
    key = (torch.randn(n, nkv, hd, generator=gen) * 30).to(DEV).to(src)
    value = torch.randn(n, nkv, hd, generator=gen).to(DEV).to(src)
    key[1, 0, :4] = 1000.0  # saturates to 448 in an fp8 cache (1000 / 0.5 > 448)
    key[2, 1, :4] = -1000.0
    slots = torch.randperm(num_blocks * tpb, generator=gen)[:n].to(torch.int32)
    slots[::7] = -1  # skipped rows
    slots = slots.to(DEV)
    k_cache = torch.zeros(num_blocks, nkv, tpb, hd, device=DEV).to(cache)
    v_cache = torch.zeros(num_blocks, nkv, tpb, hd, device=DEV).to(cache)
    ks, vs = (0.5, 0.25) if cache == FP8 else (1.0, 1.0)
    ck.store_kv(key, value, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)

    def expect(x, scale):
        if cache == FP8:
            return (x.float() / scale).clamp(-448, 448).to(FP8)
        return x.to(cache)

    ek = torch.zeros(num_blocks * tpb, nkv, hd, device=DEV).to(cache)
    ev = torch.zeros(num_blocks * tpb, nkv, hd, device=DEV).to(cache)
    keep = slots >= 0
    raw(ek)[slots[keep].long()] = raw(expect(key[keep], ks))
    raw(ev)[slots[keep].long()] = raw(expect(value[keep], vs))
    got_k = k_cache.permute(0, 2, 1, 3).reshape(-1, nkv, hd)
    got_v = v_cache.permute(0, 2, 1, 3).reshape(-1, nkv, hd)
    assert torch.equal(got_k.view(torch.uint8), ek.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), ev.view(torch.uint8))


def test_store_kv_strided_rows():
    # K and V as row views of a fused qkv projection (row stride > num_kv_heads * head_dim)
    gen = torch.Generator().manual_seed(6)
    n, nh, nkv, hd, tpb = 9, 8, 2, 64, 16
    qkv = torch.randn(n, nh + 2 * nkv, hd, generator=gen).to(DEV).to(torch.bfloat16)
    key, value = qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
    k_cache = torch.zeros(2, nkv, tpb, hd, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(n, dtype=torch.int32, device=DEV) + 3
    ck.store_kv(key, value, k_cache, v_cache, slots)
    got = k_cache.permute(0, 2, 1, 3).reshape(-1, nkv, hd)[3:3 + n]
    assert torch.equal(got, key)
    got = v_cache.permute(0, 2, 1, 3).reshape(-1, nkv, hd)[3:3 + n]
    assert torch.equal(got, value)


def test_python_checks():
    q = torch.zeros(2, 8, 64, device=DEV, dtype=torch.bfloat16)
    cache = torch.zeros(4, 4, 16, 64, device=DEV, dtype=torch.bfloat16)
    idx = torch.zeros(3, dtype=torch.int32, device=DEV)
    bt = torch.zeros(2, 4, dtype=torch.int32, device=DEV)
    ws = ck.paged_attention_workspace(2, 8, 64, 64, DEV)
    with pytest.raises(ValueError, match="^query: must be a CUDA tensor"):
        ck.paged_attention(q.cpu(), cache, cache, idx, idx[:2], bt, 0.1, max_query_len=1,
                           max_context_len=64, workspace=ws)
    with pytest.raises(ValueError, match="^k_cache:"):
        ck.paged_attention(q, cache.float(), cache.float(), idx, idx[:2], bt, 0.1,
                           max_query_len=1, max_context_len=64, workspace=ws)
    with pytest.raises(ValueError, match="^seq_lens: expected dtype torch.int32"):
        ck.paged_attention(q, cache, cache, idx, idx[:2].long(), bt, 0.1, max_query_len=1,
                           max_context_len=64, workspace=ws)
    with pytest.raises(ValueError, match=r"^softcap: must be finite and >= 0 \(0 disables it\), got -1.0"):
        ck.paged_attention(q, cache, cache, idx, idx[:2], bt, 0.1, max_query_len=1,
                           max_context_len=64, workspace=ws, softcap=-1.0)
    with pytest.raises(ValueError, match="^head_dim:"):
        q96 = torch.zeros(2, 8, 96, device=DEV, dtype=torch.bfloat16)
        c96 = torch.zeros(4, 4, 16, 96, device=DEV, dtype=torch.bfloat16)
        ck.paged_attention(q96, c96, c96, idx, idx[:2], bt, 0.1, max_query_len=1,
                           max_context_len=64, workspace=ws)
