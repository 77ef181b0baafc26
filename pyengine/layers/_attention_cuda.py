"""CUDA launches of the attention kernels behind :mod:`pyengine.layers.attention` (same
arguments and layouts; documented there).

Every tensor lives on one CUDA device and each call launches on that device's current torch
stream, with that device made current in pyengine's own CUDA runtime for the call (whatever
torch's current device is). The checks are metadata reads only (dtype, device, shape,
strides) -- nothing reads a tensor's contents or synchronizes, so the calls can be captured in
a CUDA graph. The C++ side validates the remaining host values and raises ``ValueError`` naming
the argument; the index tensors' contents are trusted.
"""

from __future__ import annotations

import torch

import pyengine.core._core as _core
from pyengine.dtypes import ACTIVATION_CODES, CACHE_CODES
from pyengine.layers._kernel_checks import attention_args, check_device, check_softcap, store_kv_args

_FP8 = CACHE_CODES[torch.float8_e4m3fn]


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


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`pyengine.layers.attention.store_kv` on CUDA tensors."""
    device = _cuda_device(key, "key")
    a = store_kv_args(key, value, k_cache, v_cache, slot_mapping, device, CACHE_CODES)
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
        device.index, _stream(device),
    )


def split_k_rows(dtype: torch.dtype, head_dim: int, max_seqs: int, max_tokens: int) -> int:
    """The most query rows of a batch that reaches the split-K (flash-decoding) kernel, for
    batches of at most ``max_seqs`` sequences and ``max_tokens`` tokens of ``dtype`` activations:
    the decode batches' ``max_seqs`` where prefill goes to the tensor-core kernel (bfloat16,
    float16 with head_dim 64/128), every batch's ``max_tokens`` where it cannot (float32,
    head_dim 256). Size :func:`paged_attention_workspace` with it."""
    return _core._cuda_paged_attention_split_k_rows(
        ACTIVATION_CODES[dtype], int(head_dim), int(max_seqs), int(max_tokens))


def workspace_bytes(num_tokens: int, num_heads: int, head_dim: int, max_context_len: int) -> int:
    """Bytes of :func:`paged_attention_workspace` (0: none needed)."""
    return _core._cuda_paged_attention_workspace_bytes(
        int(num_tokens), int(num_heads), int(head_dim), int(max_context_len))


def paged_attention_workspace(num_tokens: int, num_heads: int, head_dim: int, max_context_len: int,
                              device) -> torch.Tensor:
    """A uint8 scratch tensor large enough for :func:`paged_attention` on every batch of at most
    ``num_tokens`` query rows that reaches the split-K kernel (see :func:`split_k_rows`) whose
    KV lengths are at most ``max_context_len``."""
    nbytes = workspace_bytes(num_tokens, num_heads, head_dim, max_context_len)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, sliding_window: int = 0, *,
                    max_query_len: int, max_context_len: int, workspace: torch.Tensor,
                    out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    softcap: float = 0.0) -> torch.Tensor:
    """`pyengine.layers.attention.paged_attention` on CUDA tensors."""
    softcap = check_softcap(softcap)
    device = _cuda_device(query, "query")
    a = attention_args(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out, device,
                       CACHE_CODES)
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
        int(max_context_len), workspace.data_ptr(), workspace.numel(), device.index, _stream(device),
        softcap,
    )
    return a.out
