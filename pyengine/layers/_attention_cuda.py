"""Torch-facing CUDA attention kernels: the paged KV store and paged attention on a GPU.

Same layouts and meanings as :mod:`pyengine.layers.attention` (the CPU kernels); here every tensor lives
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

import pyengine.core._core as _core
from pyengine.layers._kernel_checks import DTYPE_CODES, attention_args, check_device, store_kv_args

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
    a = store_kv_args(key, value, k_cache, v_cache, slot_mapping, device, CACHE_DTYPE_CODES)
    if a.cache_code != a.src_code and not (a.cache_code == _FP8 and a.src_code != 0):
        raise ValueError(
            f"k_cache: dtype {k_cache.dtype} with key dtype {key.dtype} is not supported (the "
            "cache takes the key's dtype, or torch.float8_e4m3fn for bfloat16/float16 keys)"
        )
    if a.num_tokens == 0:
        return
    _core._cuda_store_kv(
        key.data_ptr(), value.data_ptr(), a.key_stride, a.value_stride, a.src_code,
        k_cache.data_ptr(), v_cache.data_ptr(), a.cache_code, float(k_scale), float(v_scale),
        slot_mapping.data_ptr(), a.num_tokens, a.num_kv_heads, a.head_dim, a.tokens_per_block,
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

    Same arguments and semantics as :func:`pyengine.layers.attention.paged_attention`, plus:

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
    a = attention_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out, device,
                       CACHE_DTYPE_CODES)
    if a.cache_code != a.q_code and not (a.cache_code == _FP8 and a.q_code != 0):
        raise ValueError(
            f"k_cache: dtype {k_cache.dtype} with query dtype {query.dtype} is not supported (the "
            "cache takes the query's dtype, or torch.float8_e4m3fn for bfloat16/float16 queries)"
        )
    if workspace.dtype != torch.uint8 or workspace.dim() != 1:
        raise ValueError(
            f"workspace: expected a 1-dim torch.uint8 tensor, got {workspace.dtype} "
            f"{tuple(workspace.shape)}"
        )
    check_device(workspace, "workspace", device)
    if not workspace.is_contiguous():
        raise ValueError("workspace: must be contiguous")
    if a.num_tokens == 0 or a.num_seqs == 0:
        return a.out
    _core._cuda_paged_attention(
        a.out.data_ptr(), a.out_stride, query.data_ptr(), a.query_stride, a.q_code,
        k_cache.data_ptr(), v_cache.data_ptr(), a.cache_code, float(k_scale), float(v_scale),
        query_start_loc.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
        a.num_seqs, a.num_tokens, block_tables.shape[1], a.num_heads, a.num_kv_heads, a.head_dim,
        a.tokens_per_block, float(scale), int(sliding_window), int(max_query_len),
        int(max_context_len), workspace.data_ptr(), workspace.numel(), _stream(device),
    )
    return a.out
