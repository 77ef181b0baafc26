"""The CUDA attention's split-K workspace, sized by the model runner, against what the batches
that reach the split-K kernel need. Arithmetic only (it answers in every build): no GPU.

The start-up failure this guards against: fp32 (and head_dim 256) prefill goes through the
split-K kernel, so the KV-capacity estimate's dummy batch -- max_num_tokens tokens of one long
prompt plus a full batch of one-token prompts -- needs a workspace for max_num_tokens rows, not
the max_batch_size rows it used to get.
"""

from __future__ import annotations

import pytest
import torch

import pyengine.core._core as _core
from pyengine.dtypes import ACTIVATION_CODES
from pyengine.layers import _attention_cuda as ck
from pyengine.runtime.model_runner import split_k_workspace_bytes

HEADS = 16
# (dtype, head_dim) -> does prefill go through the split-K kernel?
CONFIGS = [
    (torch.float32, 128, True),
    (torch.float32, 64, True),
    (torch.bfloat16, 256, True),
    (torch.float16, 256, True),
    (torch.bfloat16, 128, False),
    (torch.float16, 64, False),
]


def batch_need(dtype, head_dim, num_tokens, max_query_len, max_context_len, aligned=True) -> int:
    """Bytes one batch needs (0 on the tensor-core kernel)."""
    return _core._cuda_paged_attention_batch_workspace_bytes(
        ACTIVATION_CODES[dtype], num_tokens, HEADS, head_dim, max_query_len, max_context_len, aligned)


@pytest.mark.parametrize("dtype, head_dim, prefill_on_split_k", CONFIGS)
def test_which_kernel_a_prefill_batch_takes(dtype, head_dim, prefill_on_split_k):
    need = batch_need(dtype, head_dim, 64, 64, 4096)
    assert (need > 0) == prefill_on_split_k
    assert batch_need(dtype, head_dim, 8, 1, 4096) > 0  # decode batches always split
    assert batch_need(dtype, head_dim, 8, 1, 200) == 0  # ... when the context is long enough
    # a misaligned query leaves the tensor cores too
    assert batch_need(dtype, head_dim, 64, 64, 4096, aligned=False) > 0


@pytest.mark.parametrize("dtype, head_dim, prefill_on_split_k", CONFIGS)
@pytest.mark.parametrize("max_num_tokens", [64, 300, 512, 2048])
def test_runner_workspace_covers_every_batch(dtype, head_dim, prefill_on_split_k, max_num_tokens):
    max_batch_size, max_seq_len = 8, 4096
    sized = split_k_workspace_bytes(dtype, HEADS, head_dim, max_batch_size, max_num_tokens, max_seq_len)
    for ctx in (257, 1000, max_seq_len):
        for rows in range(1, max_batch_size + 1):  # decode
            assert batch_need(dtype, head_dim, rows, 1, ctx) <= sized, (rows, ctx)
        for tokens in range(2, max_num_tokens + 1, 5):  # prefill (one long prompt: max_query_len = tokens)
            assert batch_need(dtype, head_dim, tokens, tokens, ctx) <= sized, (tokens, ctx)
        # the largest: max_num_tokens tokens, one long prompt beside one-token ones
        worst = batch_need(dtype, head_dim, max_num_tokens, max_num_tokens - max_batch_size + 1, ctx)
        assert worst <= sized, (max_num_tokens, ctx)


@pytest.mark.parametrize("dtype, head_dim, prefill_on_split_k", CONFIGS)
@pytest.mark.parametrize("max_batch_size, max_num_tokens, max_seq_len", [(8, 512, 340), (4, 300, 2048),
                                                                         (64, 2048, 8192), (1, 400, 1024)])
def test_kv_capacity_dummy_batch_fits(dtype, head_dim, prefill_on_split_k, max_batch_size, max_num_tokens,
                                      max_seq_len):
    # as pyengine/engine/startup.py's _measure_worst_case_batch builds its runner and batch
    rows = max(1, min(max_batch_size, max_num_tokens))
    context = max(1, min(max_num_tokens - (rows - 1), max_seq_len - 1))
    tokens = context + rows - 1
    sized = split_k_workspace_bytes(dtype, HEADS, head_dim, rows, tokens, max_seq_len)
    assert batch_need(dtype, head_dim, tokens, context, context) <= sized


def test_fp32_needs_more_than_max_batch_size_rows():
    # tests/gpu's engine: fp32, max_batch_size 8, max_num_tokens 512, max_seq_len 340: the dummy
    # batch (346 tokens, a 339-token context) needs far more than decode batches of 8 rows
    need = batch_need(torch.float32, 64, 346, 339, 339)
    assert need > ck.workspace_bytes(8, HEADS, 64, 340)
    assert need <= split_k_workspace_bytes(torch.float32, HEADS, 64, 8, 512, 340)


def test_tensor_core_engines_keep_the_decode_sizing():
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.float16, 64)):
        assert (split_k_workspace_bytes(dtype, HEADS, head_dim, 8, 2048, 4096)
                == ck.workspace_bytes(8, HEADS, head_dim, 4096))


def test_workspace_is_bounded():
    # however many tokens: about 1024 rows of (head_dim + 2) floats per head at most
    for dtype, head_dim in ((torch.float32, 128), (torch.bfloat16, 256)):
        sized = split_k_workspace_bytes(dtype, HEADS, head_dim, 64, 1 << 20, 1 << 20)
        assert 0 < sized <= 1024 * HEADS * (head_dim + 2) * 4


def test_workspace_covers_smaller_batches():
    # the need is not monotone in the rows (512 rows split in two, 513 do not): the sizing is
    at_512 = batch_need(torch.float32, 128, 512, 1, 40000)
    assert batch_need(torch.float32, 128, 513, 1, 40000) == 0 < at_512
    assert ck.workspace_bytes(513, HEADS, 128, 40000) >= at_512
    sizes = [ck.workspace_bytes(n, HEADS, 128, 40000) for n in range(0, 1100, 3)]
    assert sizes == sorted(sizes)


def test_split_k_rows():
    assert ck.split_k_rows(torch.float32, 128, 8, 512) == 512
    assert ck.split_k_rows(torch.bfloat16, 256, 8, 512) == 512
    assert ck.split_k_rows(torch.bfloat16, 128, 8, 512) == 8
    assert ck.split_k_rows(torch.float16, 64, 8, 512) == 8
    with pytest.raises(ValueError, match="^max_tokens:"):
        ck.split_k_rows(torch.float32, 128, 8, -1)
