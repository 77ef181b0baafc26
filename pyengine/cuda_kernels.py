"""Torch-facing CUDA attention kernels: the paged KV store and paged attention on a GPU.

Same layouts and meanings as :mod:`pyengine.kernels` (the CPU kernels); here every tensor lives
on one CUDA device and each call launches on that device's current torch stream. The checks are
metadata reads only (dtype, device, shape, strides) -- nothing reads a tensor's contents or
synchronizes, so the calls can be captured in a CUDA graph. The C++ side validates the
remaining host values and raises ``ValueError`` naming the argument; the index tensors'
contents are trusted.

Extras over the CPU kernels:

* an fp8 KV cache (``torch.float8_e4m3fn``) for bfloat16/float16 activations, stored as
  ``value / scale`` (saturated to +-448) and read as ``stored * scale`` with per-tensor
  ``k_scale`` / ``v_scale``;
* ``paged_attention`` needs the host values ``max_query_len`` (1 selects the flash-decoding
  kernel) and ``max_context_len`` (an upper bound of ``seq_lens``; it sizes the split-K grid), and
  a ``workspace`` from :func:`paged_attention_workspace`.
"""

from __future__ import annotations

import torch

import pyengine._core as _core
from pyengine.kernel_checks import (
    DTYPE_CODES,
    check_cache,
    check_device,
    check_index,
    dtype_code,
    row_stride,
)

__all__ = [
    "is_built",
    "architectures",
    "store_kv",
    "paged_attention_workspace",
    "paged_attention",
    "CACHE_DTYPE_CODES",
]

#: torch dtype -> C++ DType value of the KV cache dtypes (activation dtypes plus fp8 e4m3).
CACHE_DTYPE_CODES: dict[torch.dtype, int] = {**DTYPE_CODES, torch.float8_e4m3fn: 3}
_FP8 = 3


def is_built() -> bool:
    """True when this pyengine build has the CUDA kernels."""
    return _core._cuda_kernels_built()


def architectures() -> str:
    """The CUDA architectures the kernels were compiled for, e.g. ``"80;90a"``."""
    return _core._cuda_architectures()


def _cuda_device(t: torch.Tensor, name: str) -> torch.device:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")
    return t.device


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes this step's K/V rows into their paged-cache slots.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` float32/bfloat16/float16 on one CUDA
            device; only the last two dims need to be contiguous.
        k_cache, v_cache: ``[num_blocks, num_kv_heads, tokens_per_block, head_dim]`` contiguous,
            in key's dtype, or ``torch.float8_e4m3fn`` for bfloat16/float16 keys.
        slot_mapping: int32 ``[num_tokens]``, ``block_id * tokens_per_block + offset``; a negative
            slot skips the row.
        k_scale, v_scale: fp8 caches store ``key / k_scale`` and ``value / v_scale``.

    Raises:
        ValueError: on a bad dtype, device, shape or layout (the message names the argument).
    """
    device = _cuda_device(key, "key")
    cache_code = check_cache(k_cache, v_cache, device, CACHE_DTYPE_CODES)
    num_blocks, num_kv_heads, tokens_per_block, head_dim = k_cache.shape
    src_code = dtype_code(key, "key", device)
    if value.dtype != key.dtype:
        raise ValueError(f"value: dtype {value.dtype} differs from key {key.dtype}")
    check_device(value, "value", device)
    if cache_code != src_code and not (cache_code == _FP8 and src_code != 0):
        raise ValueError(
            f"k_cache: dtype {k_cache.dtype} with key dtype {key.dtype} is not supported (the "
            "cache takes the key's dtype, or torch.float8_e4m3fn for bfloat16/float16 keys)"
        )
    k_stride = row_stride(key, "key", num_kv_heads, head_dim)
    v_stride = row_stride(value, "value", num_kv_heads, head_dim)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens:
        raise ValueError(f"value: {value.shape[0]} rows, key has {num_tokens}")
    check_index(slot_mapping, "slot_mapping", 1, device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    _core._cuda_store_kv(
        key.data_ptr(), value.data_ptr(), k_stride, v_stride, src_code,
        k_cache.data_ptr(), v_cache.data_ptr(), cache_code, float(k_scale), float(v_scale),
        slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim, tokens_per_block,
        _stream(device),
    )


def paged_attention_workspace(
    num_tokens: int, num_heads: int, head_dim: int, max_context_len: int, device
) -> torch.Tensor:
    """A uint8 scratch tensor large enough for :func:`paged_attention` on batches of at most
    ``num_tokens`` query rows whose KV lengths are at most ``max_context_len``."""
    nbytes = _core._cuda_paged_attention_workspace_bytes(
        int(num_tokens), int(num_heads), int(head_dim), int(max_context_len)
    )
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    max_query_len: int,
    max_context_len: int,
    workspace: torch.Tensor,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's query rows over its paged KV cache, on the GPU.

    Same arguments and semantics as :func:`pyengine.kernels.paged_attention`, plus:

    Args:
        max_query_len: the longest query of the batch (host value); 1 runs the flash-decoding
            kernel, more the prefill kernel (which also takes decode rows mixed in).
        max_context_len: an upper bound of ``seq_lens`` (host value); sizes the split-K grid.
        workspace: a uint8 tensor on the query's device from :func:`paged_attention_workspace`
            sized for at least this batch's ``num_tokens`` and ``max_context_len``.
        k_scale, v_scale: dequantization scales of an fp8 (``torch.float8_e4m3fn``) cache.

    Returns:
        ``out``, ``[num_tokens, num_heads, head_dim]`` in query's dtype.

    Raises:
        ValueError: on a bad dtype, device, shape or layout (the message names the argument).
    """
    device = _cuda_device(query, "query")
    cache_code = check_cache(k_cache, v_cache, device, CACHE_DTYPE_CODES)
    num_blocks, num_kv_heads, tokens_per_block, head_dim = k_cache.shape
    q_code = dtype_code(query, "query", device)
    if cache_code != q_code and not (cache_code == _FP8 and q_code != 0):
        raise ValueError(
            f"k_cache: dtype {k_cache.dtype} with query dtype {query.dtype} is not supported (the "
            "cache takes the query's dtype, or torch.float8_e4m3fn for bfloat16/float16 queries)"
        )
    if query.dim() != 3:
        raise ValueError(
            f"query: expected 3 dims [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    num_tokens, num_heads, q_head_dim = query.shape
    if q_head_dim != head_dim:
        raise ValueError(f"query: head_dim {q_head_dim} differs from the cache's {head_dim}")
    q_stride = row_stride(query, "query", num_heads, head_dim)
    check_index(query_start_loc, "query_start_loc", 1, device)
    check_index(seq_lens, "seq_lens", 1, device)
    check_index(block_tables, "block_tables", 2, device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc: expected {num_seqs + 1} entries (num_seqs + 1), "
            f"got {query_start_loc.shape[0]}"
        )
    if block_tables.shape[0] < num_seqs:
        raise ValueError(f"block_tables: {block_tables.shape[0]} rows for {num_seqs} sequences")
    if workspace.dtype != torch.uint8 or workspace.dim() != 1:
        raise ValueError(
            f"workspace: expected a 1-dim torch.uint8 tensor, got {workspace.dtype} "
            f"{tuple(workspace.shape)}"
        )
    check_device(workspace, "workspace", device)
    if not workspace.is_contiguous():
        raise ValueError("workspace: must be contiguous")
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=device)
        out_stride = num_heads * head_dim
    else:
        if out.dtype != query.dtype:
            raise ValueError(f"out: dtype {out.dtype} differs from query {query.dtype}")
        check_device(out, "out", device)
        out_stride = row_stride(out, "out", num_heads, head_dim)
        if out.shape[0] != num_tokens:
            raise ValueError(f"out: {out.shape[0]} rows, query has {num_tokens}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    _core._cuda_paged_attention(
        out.data_ptr(), out_stride, query.data_ptr(), q_stride, q_code,
        k_cache.data_ptr(), v_cache.data_ptr(), cache_code, float(k_scale), float(v_scale),
        query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        num_seqs, num_tokens, block_tables.shape[1], num_heads, num_kv_heads, head_dim,
        tokens_per_block, float(scale), int(sliding_window), int(max_query_len),
        int(max_context_len), workspace.data_ptr(), workspace.numel(), _stream(device),
    )
    return out
