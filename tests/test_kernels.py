"""Tests of the CPU attention kernels (pyengine.layers.attention) against naive PyTorch references."""

from __future__ import annotations

import re

import pytest
import torch

import pyengine.core._core as _core
from paged_kv import make_paged_kv, ref_attention
from pyengine.layers._kernel_checks import check_attention_contents, check_slot_contents
from pyengine.layers.attention import paged_attention, store_kv
from pyengine.layers.cpu_features import set_cpu_isa

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def tolerance(q_dtype, cache_dtype):
    if q_dtype == torch.float32:
        # inputs are exact in fp32; only fp32 accumulation differs from the fp64 reference
        return dict(atol=1e-5, rtol=1e-5)
    if q_dtype == torch.float16:
        return dict(atol=2e-3, rtol=2e-3)
    return dict(atol=8e-3, rtol=8e-3)  # bf16 output rounding: <= 2^-8 relative


def random_specs(gen, n, max_len=1000):
    """A batch mixing decode rows, prefill chunks starting mid-sequence and full prefills."""
    specs = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # decode row
            L = int(torch.randint(1, max_len + 1, (1,), generator=gen))
            specs.append((L, 1))
        elif kind == 1:  # prefill chunk after earlier KV
            prefix = int(torch.randint(1, max_len - 150, (1,), generator=gen))
            q_len = int(torch.randint(2, 150, (1,), generator=gen))
            specs.append((prefix + q_len, q_len))
        elif kind == 2:  # prefill from position 0
            q_len = int(torch.randint(2, 120, (1,), generator=gen))
            specs.append((q_len, q_len))
        else:  # long decode
            L = int(torch.randint(max_len // 2, max_len + 1, (1,), generator=gen))
            specs.append((L, 1))
    return specs


def run_case(specs, num_heads, num_kv_heads, head_dim, tokens_per_block, cache_dtype, q_dtype,
             window, seed, free_out_of_window=False, query_row_view=False):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, qsl, seq_lens, bt, kvs = make_paged_kv(
        specs, num_kv_heads, head_dim, tokens_per_block, cache_dtype, gen, window,
        free_out_of_window)
    num_tokens = sum(q for _, q in specs)
    if query_row_view:
        fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
        query = fused.to(q_dtype)[:, :num_heads]
        assert not query.is_contiguous()
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(q_dtype)
    scale = head_dim ** -0.5
    out = paged_attention(query, k_cache, v_cache, qsl, seq_lens, bt, scale, window)
    assert out.dtype == q_dtype and out.shape == query.shape
    ref = ref_attention(query, kvs, specs, scale, window)
    torch.testing.assert_close(out.double(), ref, **tolerance(q_dtype, cache_dtype))
    return out


# ---------------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------------

# (num_heads, num_kv_heads, head_dim, tokens_per_block): MHA, GQA 2 and 4, MQA; dims 64/128/80/32
SHAPES = [
    (4, 4, 64, 16),
    (4, 2, 128, 16),
    (8, 2, 80, 32),
    (8, 1, 64, 16),
    (6, 3, 32, 5),
]


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("q_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h%d_kv%d_d%d_t%d" % s)
def test_paged_attention_mixed_batch(shape, cache_dtype, q_dtype, window, cpu_isa):
    num_heads, num_kv_heads, head_dim, tpb = shape
    seed = sum(map(ord, f"{shape}{cache_dtype}{q_dtype}{window}"))  # stable across runs
    gen = torch.Generator().manual_seed(seed)
    specs = random_specs(gen, 6)
    run_case(specs, num_heads, num_kv_heads, head_dim, tpb, DTYPES[cache_dtype],
             DTYPES[q_dtype], window, seed, free_out_of_window=window > 0,
             query_row_view=(seed % 2 == 0))


def test_paged_attention_fp16_query(cpu_isa):
    specs = [(300, 1), (200, 40), (57, 57)]
    run_case(specs, 8, 2, 64, 16, torch.float16, torch.float16, 0, 1)


@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16"])
def test_split_k_long_decode(cache_dtype, cpu_isa):
    # few work items with long contexts: exercises the split-K path and its combine
    specs = [(4000, 1), (1000, 1)]
    run_case(specs, 2, 1, 64, 16, DTYPES[cache_dtype], torch.float32, 0, 2)
    run_case(specs, 4, 1, 128, 16, DTYPES[cache_dtype], torch.float32, 300, 3)
    run_case([(3000, 3)], 4, 2, 64, 16, DTYPES[cache_dtype], torch.float32, 0, 4)


@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16"])
def test_odd_head_dim_and_group(cache_dtype, cpu_isa):
    # head_dim not a multiple of 16 (vector tails), group 5 (row groups 4 + 1), 7-token blocks
    gen = torch.Generator().manual_seed(14)
    specs = random_specs(gen, 4, max_len=400)
    run_case(specs, 10, 2, 40, 7, DTYPES[cache_dtype], torch.float32, 0, 14)
    run_case(specs, 10, 2, 40, 7, DTYPES[cache_dtype], torch.bfloat16, 23, 15)


def test_long_prefill_chunk(cpu_isa):
    specs = [(1000, 600), (300, 1)]
    run_case(specs, 6, 2, 64, 16, torch.bfloat16, torch.float32, 0, 5)
    run_case(specs, 6, 2, 64, 16, torch.float32, torch.float32, 129, 6)


def test_window_one_and_empty_sequence(cpu_isa):
    # window 1: each row sees only itself; a sequence with no query rows this step is skipped
    specs = [(10, 3), (20, 0), (5, 1)]
    run_case(specs, 2, 2, 32, 4, torch.float32, torch.float32, 1, 7)
    run_case(specs, 2, 2, 32, 4, torch.float32, torch.float32, 0, 8)


def test_thread_counts_agree(cpu_isa):
    gen = torch.Generator().manual_seed(9)
    specs = random_specs(gen, 5)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = run_case(specs, 4, 2, 64, 16, torch.bfloat16, torch.float32, 0, 9)
        torch.set_num_threads(max(2, old))
        b = run_case(specs, 4, 2, 64, 16, torch.bfloat16, torch.float32, 0, 9)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(16, 8, 128), (8, 8, 64), (12, 4, 80), (32, 2, 64)])
def test_decode_rows_of_several_kv_heads_per_item(threads, num_heads, num_kv_heads, head_dim, cpu_isa):
    """One-row tiles (decode, and the last row of a prompt whose length is a tile plus one) are
    planned with several KV heads per item where the level's decode kernel runs them, and those
    items are split over the KV range when there are few of them (one long sequence): each row is
    the reference's, as when every item holds one head; a sliding window narrows every head's
    range alike."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for specs in ([(1500, 1)], [(40, 1)], [(700, 1), (33, 1), (300, 17), (5, 1)]):
            for window in (0, 100):
                for cache_dtype in (torch.float16, torch.float32):
                    run_case(specs, num_heads, num_kv_heads, head_dim, 16, cache_dtype, torch.float32, window,
                             len(specs) + window + head_dim)
    finally:
        torch.set_num_threads(old)


def test_out_argument_and_row_stride(cpu_isa):
    gen = torch.Generator().manual_seed(10)
    specs = [(50, 1), (40, 10)]
    k_cache, v_cache, qsl, seq_lens, bt, kvs = make_paged_kv(specs, 2, 64, 16, torch.float32, gen)
    query = torch.randn(11, 4, 64, generator=gen)
    big = torch.zeros(11, 6, 64)
    out = big[:, 1:5]  # strided row view
    res = paged_attention(query, k_cache, v_cache, qsl, seq_lens, bt, 0.125, out=out)
    assert res is out
    torch.testing.assert_close(out.double(), ref_attention(query, kvs, specs, 0.125, 0),
                               atol=2e-5, rtol=2e-5)
    assert torch.all(big[:, 0] == 0) and torch.all(big[:, 5] == 0)


def test_every_level_computes_the_same_attention():
    """Each instruction-set level's back end against the portable one on one mixed batch: the
    same result up to the order of fp32 additions (each level is also checked against the fp64
    reference by the tests above)."""
    levels = _core._supported_cpu_isas()
    gen = torch.Generator().manual_seed(11)
    specs = random_specs(gen, 6)
    previous = _core._cpu_isa()
    outs = {}
    try:
        for level in levels:
            set_cpu_isa(level)
            outs[level] = run_case(specs, 8, 2, 80, 16, torch.bfloat16, torch.float32, 0, 11)
    finally:
        set_cpu_isa(previous)
    for level in levels:
        torch.testing.assert_close(outs[level], outs["generic"], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# store_kv
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("src_dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("cache_dtype", ["fp32", "bf16", "fp16"])
def test_store_kv_placement(src_dtype, cache_dtype, cpu_isa):
    gen = torch.Generator().manual_seed(20)
    num_blocks, H, T, D = 9, 3, 16, 80
    sd, cd = DTYPES[src_dtype], DTYPES[cache_dtype]
    n = 50
    # key/value as row views of a fused qkv tensor (non-contiguous rows)
    fused = (torch.randn(n, 4 + 2 * H, D, generator=gen) * 3).to(sd)
    key, value = fused[:, 4:4 + H], fused[:, 4 + H:]
    slots = torch.randperm(num_blocks * T, generator=gen)[:n].to(torch.int32)
    slots[[3, 17, 40]] = -1  # skipped rows
    k_cache = torch.randn(num_blocks, H, T, D, generator=gen).to(cd)
    v_cache = torch.randn(num_blocks, H, T, D, generator=gen).to(cd)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    store_kv(key, value, k_cache, v_cache, slots)

    k_exp, v_exp = k_before.clone(), v_before.clone()
    keep = slots >= 0
    s = slots[keep].long()
    k_exp[s // T, :, s % T] = key[keep].to(cd)
    v_exp[s // T, :, s % T] = value[keep].to(cd)
    # bit-exact: same placement and the same (round-to-nearest-even) conversion as torch
    assert torch.equal(k_cache.view(-1).view(torch.uint8), k_exp.view(-1).view(torch.uint8))
    assert torch.equal(v_cache.view(-1).view(torch.uint8), v_exp.view(-1).view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp16"])
def test_store_kv_conversion_edge_cases(cache_dtype, cpu_isa):
    cd = DTYPES[cache_dtype]
    bits = torch.cat([
        torch.randint(-2 ** 31, 2 ** 31 - 1, (20000,), generator=torch.Generator().manual_seed(21),
                      dtype=torch.int64).to(torch.int32),
        # halfway / rounding cases around bf16 and fp16 ulps, subnormals, overflow, inf, nan
        torch.tensor([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x477FF000, 0x477FEFFF,
                      0x477FE000, 0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FFFFF,
                      0x7F800000, 0xFF800000 - 2 ** 32, 0x7FC00000, 0x7F800001, 0x00000001,
                      0x80000000 - 2 ** 32, 0], dtype=torch.int64).to(torch.int32),
    ])
    vals = bits.view(torch.float32)
    n = vals.numel() // 16 * 16
    key = vals[:n].reshape(-1, 1, 16)
    T = 8
    num_blocks = n // 16 // T + 1
    k_cache = torch.zeros(num_blocks, 1, T, 16, dtype=cd)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.arange(key.shape[0], dtype=torch.int32)
    store_kv(key, key, k_cache, v_cache, slots)
    got = k_cache.view(-1)[:n]
    exp = key.reshape(-1).to(cd)
    nan = torch.isnan(exp)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int16), exp[~nan].view(torch.int16))
    # and back: fp16/bf16 source into an fp32 cache is exact
    f_cache = torch.zeros(num_blocks, 1, T, 16)
    store_kv(exp.reshape(-1, 1, 16), exp.reshape(-1, 1, 16), f_cache, f_cache.clone(), slots)
    back = f_cache.view(-1)[:n]
    assert torch.equal(torch.isnan(back), nan)
    assert torch.equal(back[~nan], exp[~nan].float())


def test_store_then_attend_roundtrip(cpu_isa):
    """store_kv + paged_attention together, as the model uses them (decode step)."""
    gen = torch.Generator().manual_seed(22)
    H, Hkv, D, T = 4, 2, 64, 16
    specs = [(33, 33), (17, 17)]
    k_cache, v_cache, qsl, seq_lens, bt, kvs = make_paged_kv(specs, Hkv, D, T, torch.bfloat16, gen)
    # one decode step for each sequence: write the new row through store_kv
    new_k = torch.randn(2, Hkv, D, generator=gen)
    new_v = torch.randn(2, Hkv, D, generator=gen)
    slots = []
    for i, (L, _) in enumerate(specs):
        slots.append(int(bt[i, L // T]) * T + L % T)
    store_kv(new_k, new_v, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32))
    specs2 = [(34, 1), (18, 1)]
    kvs2 = [(torch.cat([k, new_k[i:i + 1].bfloat16()]), torch.cat([v, new_v[i:i + 1].bfloat16()]))
            for i, (k, v) in enumerate(kvs)]
    query = torch.randn(2, H, D, generator=gen)
    out = paged_attention(query, k_cache, v_cache, torch.tensor([0, 1, 2], dtype=torch.int32),
                          torch.tensor([34, 18], dtype=torch.int32), bt, D ** -0.5)
    torch.testing.assert_close(out.double(), ref_attention(query, kvs2, specs2, D ** -0.5, 0),
                               atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# argument validation
# ---------------------------------------------------------------------------------------------


def _attn_args():
    gen = torch.Generator().manual_seed(30)
    specs = [(20, 1), (10, 4)]
    k_cache, v_cache, qsl, seq_lens, bt, _ = make_paged_kv(specs, 2, 32, 8, torch.float32, gen)
    query = torch.randn(5, 4, 32, generator=gen)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, query_start_loc=qsl,
                seq_lens=seq_lens, block_tables=bt, scale=0.2)


@pytest.mark.parametrize("change, name", [
    (lambda a: a.update(query=a["query"].long()), "query"),
    (lambda a: a.update(query=a["query"][:, :3]), "num_heads"),  # 3 heads over 2 KV heads
    (lambda a: a.update(query=a["query"][..., :16]), "query"),
    (lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)), "query"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2)), "k_cache"),
    (lambda a: a.update(v_cache=a["v_cache"].bfloat16()), "v_cache"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens"),
    (lambda a: a.update(seq_lens=torch.tensor([20, 3], dtype=torch.int32)), "seq_lens"),
    (lambda a: a.update(seq_lens=torch.tensor([20, 900], dtype=torch.int32)), "seq_lens"),
    (lambda a: a.update(query_start_loc=torch.tensor([0, 3, 1], dtype=torch.int32)),
     "query_start_loc"),
    (lambda a: a.update(query_start_loc=torch.tensor([0, 1], dtype=torch.int32)),
     "query_start_loc"),
    (lambda a: a["block_tables"].__setitem__((1, 0), -1), "block_tables"),
    (lambda a: a.update(block_tables=a["block_tables"][:, ::2]), "block_tables"),
    (lambda a: a.update(sliding_window=-2), "sliding_window"),
    (lambda a: a.update(out=torch.empty(5, 4, 32, dtype=torch.bfloat16)), "out"),
])
def test_paged_attention_bad_arguments(change, name):
    args = _attn_args()
    paged_attention(**args)  # the unmodified arguments are fine
    change(args)
    with pytest.raises(ValueError, match=name):
        paged_attention(**args)


@pytest.mark.parametrize("change, name", [
    (lambda a: a.update(key=a["key"].double()), "key"),
    (lambda a: a.update(value=a["value"].bfloat16()), "value"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].long()), "slot_mapping"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:2]), "slot_mapping"),
    (lambda a: a.update(k_cache=a["k_cache"][:, :1]), "k_cache"),
    (lambda a: a.update(v_cache=a["v_cache"][..., :8]), "v_cache"),
])
def test_store_kv_bad_arguments(change, name):
    args = dict(key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16),
                k_cache=torch.zeros(4, 2, 8, 16), v_cache=torch.zeros(4, 2, 8, 16),
                slot_mapping=torch.tensor([0, 5, 9], dtype=torch.int32))
    store_kv(**args)
    change(args)
    with pytest.raises(ValueError, match=name):
        store_kv(**args)


def test_core_bindings_validate():
    k = torch.zeros(2, 1, 8)
    cache = torch.zeros(1, 1, 4, 8)
    slots = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="key"):
        _core._store_kv(0, k.data_ptr(), 8, 8, 0, cache.data_ptr(), cache.data_ptr(), 0,
                        slots.data_ptr(), 2, 1, 8, 4, 1)
    with pytest.raises(ValueError, match="src_dtype"):
        _core._store_kv(k.data_ptr(), k.data_ptr(), 8, 8, 7, cache.data_ptr(), cache.data_ptr(),
                        0, slots.data_ptr(), 2, 1, 8, 4, 1)
    with pytest.raises(ValueError, match="head_dim"):
        _core._store_kv(k.data_ptr(), k.data_ptr(), 8, 8, 0, cache.data_ptr(), cache.data_ptr(),
                        0, slots.data_ptr(), 2, 1, 0, 4, 1)
    i32 = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.zeros(1, 3, 8)
    with pytest.raises(ValueError, match="num_heads"):
        _core._paged_attention(q.data_ptr(), 24, q.data_ptr(), 24, 0, cache.data_ptr(),
                               cache.data_ptr(), 0, i32.data_ptr(), i32.data_ptr(),
                               i32.data_ptr(), 1, 1, 1, 3, 2, 8, 4, 1, 0.3, 0, 1)
    with pytest.raises(ValueError, match="cache_dtype"):
        _core._paged_attention(q.data_ptr(), 24, q.data_ptr(), 24, 0, cache.data_ptr(),
                               cache.data_ptr(), 5, i32.data_ptr(), i32.data_ptr(),
                               i32.data_ptr(), 1, 1, 1, 3, 1, 8, 4, 1, 0.3, 0, 1)
    with pytest.raises(ValueError, match="block_tables"):
        _core._paged_attention(q.data_ptr(), 24, q.data_ptr(), 24, 0, cache.data_ptr(),
                               cache.data_ptr(), 0, i32.data_ptr(), i32.data_ptr(), 0, 1, 1, 1,
                               3, 1, 8, 4, 1, 0.3, 0, 1)
    assert _core._dtype_size(1) == 2


# ---------------------------------------------------------------------------------------------
# index contents: bounded against the pool before anything is read or written
# ---------------------------------------------------------------------------------------------


def _bad_attention_indices():
    def block_past_pool(a):
        a["block_tables"][0, 1] = a["k_cache"].shape[0]
        return f"block_tables: block id {a['k_cache'].shape[0]} for sequence 0, block 1 is outside the cache's"

    def rows_past_query(a):
        a["query_start_loc"] = torch.tensor([0, 1, 7], dtype=torch.int32)
        a["seq_lens"] = torch.tensor([20, 10], dtype=torch.int32)
        return "query_start_loc: ends at 7, beyond the 5 query rows"

    def huge_block_id(a):
        a["block_tables"][1, 0] = 2**31 - 1
        return "block_tables: block id 2147483647 for sequence 1, block 0 is outside"
    return [block_past_pool, rows_past_query, huge_block_id]


@pytest.mark.parametrize("corrupt", _bad_attention_indices())
def test_paged_attention_bounds_index_contents(corrupt):
    """A caller's bad index is a ValueError naming the value, never an out-of-bounds read. The
    host-side check the CUDA path offers (check_indices=True) says the same."""
    args = _attn_args()
    message = corrupt(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        paged_attention(**args)
    with pytest.raises(ValueError, match=re.escape(message)):
        check_attention_contents(args["query_start_loc"], args["seq_lens"], args["block_tables"],
                                 args["query"].shape[0], args["k_cache"].shape[0], args["k_cache"].shape[2])


@pytest.mark.parametrize("slot", [32, 40, 2**31 - 1])
def test_store_kv_bounds_slots(slot):
    cache = torch.zeros(4, 2, 8, 16)  # 4 blocks of 8: slots 0..31
    args = dict(key=torch.randn(3, 2, 16), value=torch.randn(3, 2, 16), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.tensor([0, slot, 9], dtype=torch.int32))
    message = f"slot_mapping: entry 1 is {slot}, beyond the cache's 32 slots (4 blocks of 8)"
    with pytest.raises(ValueError, match=re.escape(message)):
        store_kv(**args)
    assert not cache.any()  # checked before the first row was written
    with pytest.raises(ValueError, match=re.escape(message)):
        check_slot_contents(args["slot_mapping"], 4, 8)
    args["slot_mapping"] = torch.tensor([0, 31, -1], dtype=torch.int32)
    store_kv(**args)
    check_slot_contents(args["slot_mapping"], 4, 8)
