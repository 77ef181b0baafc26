"""Paged attention for the model: the KV store and paged attention, one front end for the
CPU kernels and the CUDA (CUTLASS/CuTe) kernels.

Given CPU tensors the functions run the C++ CPU kernels; given CUDA tensors they launch the
CUDA kernels on the device's current torch stream (``pyengine.layers._attention_cuda``), so the
model code calls one function whatever its device.

Both functions run once per layer per step, so the checks here are kept to cheap metadata
reads (dtype, shape, strides). On the CPU the C++ kernels validate the index tensors' contents
in a cheap pass before touching memory -- every slot against the cache's
``num_blocks * tokens_per_block``, every block id a sequence uses against ``num_blocks``,
``seq_lens`` against the table width, ``query_start_loc`` against the query rows -- and raise
``ValueError`` naming the argument and the value. On CUDA the kernels trust the contents
(reading them would synchronize with the device every layer): pass ``check_indices=True`` to
check them on the host first (one device-to-host copy); the engine's own calls use the batch
manager's metadata, which is built within these bounds. Data pointers are handed to the C++ core (``pyengine.core._core``) without copies, and the
kernels run without the GIL.

Layouts (see ``csrc/include/pyengine/kernels.h``):

* key / value / query / out: ``[num_tokens, num_heads, head_dim]``; the last two dims must be
  contiguous, the row stride is free (a row view of a fused qkv projection is fine).
* k_cache / v_cache: ``[num_blocks, num_kv_heads, tokens_per_block, head_dim]``, contiguous.
* slot_mapping: int32 ``[num_tokens]``, ``block_id * tokens_per_block + offset``; ``< 0`` skips.
* query_start_loc: int32 ``[num_seqs + 1]``; seq_lens: int32 ``[num_seqs]`` (KV length including
  this step's rows); block_tables: int32 ``[num_seqs, max_blocks_per_seq]``.
"""

from __future__ import annotations

import torch

import pyengine.core._core as _core
from pyengine.layers import _attention_cuda
from pyengine.layers._kernel_checks import (attention_args, check_attention_contents, check_slot_contents,
                                            check_softcap, store_kv_args)

__all__ = ["store_kv", "paged_attention", "paged_attention_workspace"]


def _check_unit_scales(k_scale: float, v_scale: float) -> None:
    if k_scale != 1.0 or v_scale != 1.0:
        raise ValueError(f"k_scale/v_scale: the CPU kernels have no fp8 cache, so the scales must be 1.0, "
                         f"got {k_scale}, {v_scale}")


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    check_indices: bool = False,
) -> None:
    """Writes this step's K/V rows into their paged-cache slots (converting dtype if needed).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` float32/bfloat16/float16; only the
            last two dims need to be contiguous.
        k_cache, v_cache: ``[num_blocks, num_kv_heads, tokens_per_block, head_dim]`` contiguous,
            float32/bfloat16/float16 (the cache dtype; rows are rounded to nearest even).
        slot_mapping: int32 ``[num_tokens]``, ``block_id * tokens_per_block + offset`` per row;
            a negative slot skips that row.
        k_scale, v_scale: per-tensor scales of an fp8 cache (CUDA only; 1.0 elsewhere): the
            cache stores ``key / k_scale`` and ``value / v_scale``, saturated to +-448.

        check_indices: CUDA only (the CPU kernel always checks): check the slots against the
            cache on the host first (copies slot_mapping to the host: synchronizes).

    On CUDA the cache may be ``torch.float8_e4m3fn`` for bfloat16/float16 keys.

    Raises:
        ValueError: on a bad dtype, device, shape or layout, or a slot beyond the cache (the
            message names the argument).
    """
    if key.is_cuda:
        if check_indices:
            check_slot_contents(slot_mapping, k_cache.shape[0], k_cache.shape[2])
        return _attention_cuda.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    _check_unit_scales(k_scale, v_scale)
    a = store_kv_args(key, value, k_cache, v_cache, slot_mapping)
    if a.num_tokens == 0:
        return
    _core._store_kv(
        key.data_ptr(), value.data_ptr(), a.key_stride, a.value_stride, a.src_code,
        k_cache.data_ptr(), v_cache.data_ptr(), a.cache_code, slot_mapping.data_ptr(),
        a.num_tokens, a.num_kv_heads, a.head_dim, a.tokens_per_block, k_cache.shape[0],
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_context_len: int | None = None,
    workspace: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    check_indices: bool = False,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged KV cache.

    One call serves a batch mixing prefill chunks and decode rows: the query rows of sequence
    ``i`` are ``query_start_loc[i] : query_start_loc[i + 1]`` and its row ``j`` sits at position
    ``seq_lens[i] - q_len + j``; it attends to KV positions ``0 .. position`` (the cache must
    already hold this step's K/V, see :func:`store_kv`). GQA/MQA: query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float32/bfloat16/float16; only the last two
            dims need to be contiguous.
        k_cache, v_cache: ``[num_blocks, num_kv_heads, tokens_per_block, head_dim]`` contiguous.
        query_start_loc: int32 ``[num_seqs + 1]``, non-decreasing.
        seq_lens: int32 ``[num_seqs]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]`` contiguous.
        scale: softmax scale applied to q.k (typically ``head_dim ** -0.5``).
        sliding_window: if > 0, a query at position p only sees positions
            ``p - sliding_window + 1 .. p``.
        out: optional ``[num_tokens, num_heads, head_dim]`` output in query's dtype (last two
            dims contiguous); allocated when not given.
        max_query_len, max_context_len, workspace: CUDA only (ignored on the CPU): the longest
            query of the batch (1 selects the flash-decoding kernel, more the prefill kernel,
            which also takes decode rows mixed in) and an upper bound of ``seq_lens`` -- host
            values, so a launch reads nothing back from the GPU; it sizes the split-K grid --
            and a uint8 scratch tensor from :func:`paged_attention_workspace` sized for at
            least this batch's ``num_tokens`` and ``max_context_len``.
        k_scale, v_scale: dequantization scales of an fp8 (``torch.float8_e4m3fn``) cache (CUDA
            only; 1.0 on the CPU).
        check_indices: CUDA only (the CPU kernel always checks): check the index tensors'
            contents on the host first (copies them to the host: synchronizes).
        softcap: attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``): if > 0,
            each score ``s = scale * q.k`` becomes ``softcap * tanh(s / softcap)`` before the
            causal / sliding-window mask and the softmax. 0 (the default) turns it off.

    Returns:
        ``out``, ``[num_tokens, num_heads, head_dim]`` in query's dtype.

    Raises:
        ValueError: on a bad dtype, device, shape or layout, inconsistent index tensors, or a
            negative, infinite or NaN softcap (the message names the argument).
    """
    softcap = check_softcap(softcap)
    if query.is_cuda:
        if max_query_len is None or max_context_len is None or workspace is None:
            raise ValueError("paged_attention on CUDA needs max_query_len, max_context_len and workspace")
        if check_indices:
            check_attention_contents(query_start_loc, seq_lens, block_tables, query.shape[0], k_cache.shape[0],
                                     k_cache.shape[2], sliding_window)
        return _attention_cuda.paged_attention(
            query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window,
            max_query_len=max_query_len, max_context_len=max_context_len, workspace=workspace, out=out,
            k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    _check_unit_scales(k_scale, v_scale)
    a = attention_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if a.num_tokens == 0 or a.num_seqs == 0:
        return a.out
    _core._paged_attention(
        a.out.data_ptr(), a.out_stride, query.data_ptr(), a.query_stride, a.q_code,
        k_cache.data_ptr(), v_cache.data_ptr(), a.cache_code, query_start_loc.data_ptr(),
        seq_lens.data_ptr(), block_tables.data_ptr(), a.num_seqs, a.num_tokens, block_tables.shape[1],
        a.num_heads, a.num_kv_heads, a.head_dim, a.tokens_per_block, k_cache.shape[0], float(scale),
        int(sliding_window), torch.get_num_threads(), softcap,
    )
    return a.out


def paged_attention_workspace(num_tokens: int, num_heads: int, head_dim: int, max_context_len: int,
                              device: torch.device | str) -> torch.Tensor:
    """A uint8 scratch tensor on ``device`` for the CUDA :func:`paged_attention` on batches of at
    most ``num_tokens`` query rows whose KV lengths are at most ``max_context_len`` (empty where
    the CUDA kernels are not built)."""
    return _attention_cuda.paged_attention_workspace(num_tokens, num_heads, head_dim, max_context_len, device)
