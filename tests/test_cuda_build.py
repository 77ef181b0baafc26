"""The CUDA kernels' build and host-side validation; runs without a GPU.

Skipped when pyengine was built without its CUDA kernels. Every bad argument must raise
ValueError naming it *before* any CUDA call, so the dummy device addresses used here are never
touched (and no GPU or driver is needed).
"""

from __future__ import annotations

import re

import pytest

import pyengine.core._core as _core

pytestmark = pytest.mark.skipif(
    not _core._cuda_kernels_built(),
    reason="pyengine was built without its CUDA kernels (no nvcc / CUTLASS, or PYENGINE_CUDA=OFF)",
)

FP32, BF16, FP16, FP8 = 0, 1, 2, 3
ADDR = 1 << 20  # a dummy, 16-byte aligned "device address"


def attention_args(**over):
    """Valid arguments of _cuda_paged_attention (a decode batch), with overrides."""
    args = dict(
        out=ADDR, out_row_stride=16 * 128, query=ADDR, query_row_stride=16 * 128, q_dtype=BF16,
        k_cache=ADDR, v_cache=ADDR, cache_dtype=BF16, k_scale=1.0, v_scale=1.0,
        query_start_loc=ADDR, seq_lens=ADDR, block_tables=ADDR, num_seqs=4, num_tokens=4,
        max_blocks_per_seq=8, num_heads=16, num_kv_heads=8, head_dim=128, tokens_per_block=16,
        scale=0.125, sliding_window=0, max_query_len=1, max_context_len=128, workspace=ADDR,
        workspace_bytes=1 << 30, device=0, stream=0,
    )
    args.update(over)
    return args


def store_args(**over):
    args = dict(
        key=ADDR, value=ADDR, key_row_stride=8 * 128, value_row_stride=8 * 128, src_dtype=BF16,
        k_cache=ADDR, v_cache=ADDR, cache_dtype=BF16, k_scale=1.0, v_scale=1.0,
        slot_mapping=ADDR, num_tokens=4, num_kv_heads=8, head_dim=128, tokens_per_block=16,
        device=0, stream=0,
    )
    args.update(over)
    return args


def attention(**over):
    _core._cuda_paged_attention(*attention_args(**over).values())


def store(**over):
    _core._cuda_store_kv(*store_args(**over).values())


def test_architectures():
    archs = _core._cuda_architectures()
    assert archs, "a CUDA build reports its architectures"
    for arch in archs.split(";"):
        assert re.fullmatch(r"\d+[af]?(-real|-virtual)?", arch), archs


def test_workspace_bytes():
    ws = _core._cuda_paged_attention_workspace_bytes
    assert ws(0, 16, 128, 4096) == 0
    assert ws(64, 16, 128, 100) == 0  # one split
    big = ws(64, 16, 128, 32768)
    assert big > 0 and big % 16 == 0
    assert ws(64, 16, 128, 65536) == big  # bounded split count
    # enough for every batch of at most num_tokens rows, however many: at most ~1024 rows' worth
    assert ws(100000, 32, 128, 32768) == ws(512, 32, 128, 32768) <= 1024 * 32 * 130 * 4
    with pytest.raises(ValueError, match="num_tokens"):
        ws(-1, 16, 128, 4096)
    with pytest.raises(ValueError, match="max_context_len"):
        ws(1, 16, 128, -5)


@pytest.mark.parametrize(
    "over, name",
    [
        (dict(q_dtype=FP8, cache_dtype=FP8), "q_dtype"),
        (dict(q_dtype=7), "q_dtype"),
        (dict(q_dtype=FP32, cache_dtype=FP8), "cache_dtype"),
        (dict(q_dtype=BF16, cache_dtype=FP16), "cache_dtype"),
        (dict(head_dim=96), "head_dim"),
        (dict(head_dim=32), "head_dim"),
        (dict(num_heads=12, num_kv_heads=8), "num_heads"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(tokens_per_block=12), "tokens_per_block"),
        (dict(tokens_per_block=0), "tokens_per_block"),
        (dict(max_blocks_per_seq=0), "max_blocks_per_seq"),
        (dict(sliding_window=-1), "sliding_window"),
        (dict(scale=float("nan")), "scale"),
        (dict(softcap=-1.0), "softcap"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
        (dict(num_seqs=-1), "num_seqs"),
        (dict(max_query_len=-1), "max_query_len"),
        (dict(max_query_len=0), "max_query_len"),
        (dict(max_context_len=-1), "max_context_len"),
        (dict(cache_dtype=FP8, k_scale=0.0), "k_scale"),
        (dict(cache_dtype=FP8, v_scale=float("inf")), "v_scale"),
        (dict(out=0), "out"),
        (dict(query=0), "query"),
        (dict(k_cache=0), "k_cache"),
        (dict(v_cache=ADDR + 2), "v_cache"),
        (dict(query_start_loc=0), "query_start_loc"),
        (dict(seq_lens=0), "seq_lens"),
        (dict(block_tables=0), "block_tables"),
        (dict(query_row_stride=100), "query_row_stride"),
        (dict(out_row_stride=100), "out_row_stride"),
        (dict(max_context_len=32768, workspace_bytes=16), "workspace_bytes"),
        (dict(max_context_len=32768, workspace=0), "workspace"),
        (dict(device=-1), "device"),
    ],
)
def test_paged_attention_rejects(over, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        attention(**over)


def test_only_split_k_batches_need_the_workspace():
    # device=-1 is refused right after the workspace check, before any CUDA call: reaching it
    # means the workspace was accepted
    prefill = dict(num_tokens=400, max_query_len=100, max_context_len=32768, workspace=0, workspace_bytes=0,
                   device=-1)
    with pytest.raises(ValueError, match=r"^device: must be >= 0"):
        attention(**prefill, q_dtype=BF16, cache_dtype=BF16)  # tensor cores: no workspace
    with pytest.raises(ValueError, match=r"^workspace_bytes: 0 is less than the \d+ bytes this batch needs"):
        attention(**prefill, q_dtype=FP32, cache_dtype=FP32)  # fp32 prefill: split-K
    with pytest.raises(ValueError, match=r"^workspace_bytes:"):
        attention(**prefill, q_dtype=BF16, cache_dtype=BF16, head_dim=256, out_row_stride=16 * 256,
                  query_row_stride=16 * 256)  # head_dim 256 prefill: split-K


def test_paged_attention_empty_batch_launches_nothing():
    # nothing to do: returns before any CUDA call, so this passes without a GPU
    attention(num_tokens=0)
    attention(num_seqs=0)


@pytest.mark.parametrize(
    "over, name",
    [
        (dict(src_dtype=FP8, cache_dtype=FP8), "src_dtype"),
        (dict(src_dtype=FP32, cache_dtype=FP8), "cache_dtype"),
        (dict(src_dtype=BF16, cache_dtype=FP16), "cache_dtype"),
        (dict(num_tokens=-1), "num_tokens"),
        (dict(num_kv_heads=0), "num_kv_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(tokens_per_block=0), "tokens_per_block"),
        (dict(key_row_stride=8), "key_row_stride"),
        (dict(value_row_stride=8), "value_row_stride"),
        (dict(cache_dtype=FP8, k_scale=-1.0), "k_scale"),
        (dict(cache_dtype=FP8, v_scale=0.0), "v_scale"),
        (dict(key=0), "key"),
        (dict(value=0), "value"),
        (dict(k_cache=0), "k_cache"),
        (dict(v_cache=0), "v_cache"),
        (dict(slot_mapping=0), "slot_mapping"),
        (dict(device=-1), "device"),
    ],
)
def test_store_kv_rejects(over, name):
    with pytest.raises(ValueError, match=rf"^{name}:"):
        store(**over)


def test_store_kv_empty_launches_nothing():
    store(num_tokens=0)


def test_torch_module_rejects_cpu_tensors():
    import torch

    from pyengine.layers import _attention_cuda as ck

    assert ck.is_built() and ck.architectures() == _core._cuda_architectures()
    q = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 4, 16, 64, dtype=torch.bfloat16)
    idx = torch.zeros(3, dtype=torch.int32)
    ws = ck.paged_attention_workspace(2, 8, 64, 64, "cpu")
    assert ws.dtype == torch.uint8 and ws.numel() == 0
    with pytest.raises(ValueError, match="^query: must be a CUDA tensor"):
        ck.paged_attention(q, cache, cache, idx, idx[:2], idx[None], 0.1, max_query_len=1,
                           max_context_len=64, workspace=ws)
    with pytest.raises(ValueError, match="^key: must be a CUDA tensor"):
        ck.store_kv(q[:, :4], q[:, :4], cache, cache, idx[:2])


Q8_0, Q8_0X8 = 8, 208  # a plain layout, and its interleaved (CPU-only) one


def quant_linear_args(**over):
    """Valid arguments of _cuda_linear_quant (Q8_0 weights [64, 256], bf16 x of 2 rows)."""
    args = dict(y=ADDR, ldy=64, x=ADDR, ldx=256, dtype=BF16, M=2, weight=ADDR, type_id=Q8_0, N=64, K=256,
                bias=0, device=0, stream=0)
    args.update(over)
    return args


def dequantize_args(**over):
    """Valid arguments of _cuda_dequantize_rows (rows of Q8_0 weights [64, 256] into bf16)."""
    args = dict(out=ADDR, ldo=256, dtype=BF16, weight=ADDR, type_id=Q8_0, N=64, K=256, ids=0, base=0, rows=4,
                device=0, stream=0)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, name",
    [
        (dict(y=0), "y/x/weight"), (dict(x=0), "y/x/weight"), (dict(weight=0), "y/x/weight"),
        (dict(M=0), "M"), (dict(N=0), "N"), (dict(K=100), "K"), (dict(type_id=99), "type"),
        (dict(type_id=Q8_0X8), "type"), (dict(dtype=FP8), "dtype"), (dict(ldx=128), "ldx"), (dict(ldy=32), "ldy"),
    ],
)
def test_linear_quant_rejects(over, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        _core._cuda_linear_quant(*quant_linear_args(**over).values())


@pytest.mark.parametrize(
    "over, name",
    [
        (dict(out=0), "out"), (dict(weight=0), "weight"), (dict(N=0), "N"), (dict(K=100), "K"),
        (dict(type_id=Q8_0X8), "type"), (dict(dtype=FP8), "dtype"), (dict(ldo=128), "ldo"), (dict(rows=-1), "rows"),
    ],
)
def test_dequantize_rows_rejects(over, name):
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}:"):
        _core._cuda_dequantize_rows(*dequantize_args(**over).values())


def test_dequantize_rows_of_none_launches_nothing():
    _core._cuda_dequantize_rows(*dequantize_args(rows=0).values())
