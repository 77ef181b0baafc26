"""Argument checks shared by the torch-facing kernel modules (``pyengine.layers.attention`` on the CPU,
``pyengine.layers._attention_cuda`` on CUDA devices).

Only cheap metadata reads (dtype, device, shape, strides): nothing here reads tensor contents,
so nothing synchronizes with a device. Every error is a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

import pyengine.core._core as _core

from pyengine.dtypes import ACTIVATION_CODES as DTYPE_CODES

_CPU = torch.device("cpu")
_F32 = torch.finfo(torch.float32)


def check_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    """Raises unless ``t`` lives on ``device`` (the CPU, or the call's CUDA device)."""
    if device.type == "cpu":
        if not t.is_cpu:
            raise ValueError(f"{name}: must be a CPU tensor, got device {t.device}")
    elif t.device != device:
        raise ValueError(f"{name}: must be on device {device}, got device {t.device}")


def dtype_code(
    t: torch.Tensor, name: str, device: torch.device = _CPU, codes: dict | None = None
) -> int:
    """The DType value of ``t`` (one of ``codes``, default the activation dtypes), checking its
    device."""
    codes = DTYPE_CODES if codes is None else codes
    code = codes.get(t.dtype)
    if code is None:
        names = ", ".join(str(d).replace("torch.", "") for d in codes)
        if codes is DTYPE_CODES:
            names = "float32, bfloat16 or float16"
        raise ValueError(f"{name}: dtype {t.dtype} is not supported ({names})")
    check_device(t, name, device)
    return code


def row_stride(t: torch.Tensor, name: str, heads: int, head_dim: int) -> int:
    """Checks a ``[num_tokens, heads, head_dim]`` tensor whose last two dims are contiguous and
    returns its row stride in elements."""
    if t.dim() != 3:
        raise ValueError(f"{name}: expected 3 dims [num_tokens, heads, head_dim], got {tuple(t.shape)}")
    n, h, d = t.shape
    if h != heads or d != head_dim:
        raise ValueError(
            f"{name}: expected shape [num_tokens, {heads}, {head_dim}], got {tuple(t.shape)}"
        )
    s0, s1, s2 = t.stride()
    if (s2 != 1 and d > 1) or (s1 != d and h > 1):
        raise ValueError(
            f"{name}: the last two dims (heads, head_dim) must be contiguous, strides {t.stride()}"
        )
    return s0 if n > 1 else h * d


def check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    device: torch.device = _CPU,
    codes: dict | None = None,
) -> int:
    """Checks a ``[num_blocks, num_kv_heads, tokens_per_block, head_dim]`` K/V cache pair and
    returns its DType value."""
    if k_cache.dim() != 4:
        raise ValueError(
            "k_cache: expected 4 dims [num_blocks, num_kv_heads, tokens_per_block, head_dim], "
            f"got {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    if not k_cache.is_contiguous():
        raise ValueError("k_cache: must be contiguous")
    if not v_cache.is_contiguous():
        raise ValueError("v_cache: must be contiguous")
    code = dtype_code(k_cache, "k_cache", device, codes)
    check_device(v_cache, "v_cache", device)
    return code


def check_index(t: torch.Tensor, name: str, dims: int, device: torch.device = _CPU) -> None:
    """Checks an int32 index tensor (slot_mapping, query_start_loc, seq_lens, block_tables)."""
    if t.dtype != torch.int32:
        raise ValueError(f"{name}: expected dtype torch.int32, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dim(s), got shape {tuple(t.shape)}")
    check_device(t, name, device)
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


@dataclass
class StoreKvArgs:
    src_code: int
    cache_code: int
    key_stride: int
    value_stride: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int


def store_kv_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, device: torch.device = _CPU,
                  cache_codes: dict | None = None) -> StoreKvArgs:
    """The checks every store_kv shares (dtypes, devices, shapes, layouts), and its sizes."""
    cache_code = check_cache(k_cache, v_cache, device, cache_codes)
    _num_blocks, num_kv_heads, tokens_per_block, head_dim = k_cache.shape
    src_code = dtype_code(key, "key", device)
    if value.dtype != key.dtype:
        raise ValueError(f"value: dtype {value.dtype} differs from key {key.dtype}")
    check_device(value, "value", device)
    k_stride = row_stride(key, "key", num_kv_heads, head_dim)
    v_stride = row_stride(value, "value", num_kv_heads, head_dim)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens:
        raise ValueError(f"value: {value.shape[0]} rows, key has {num_tokens}")
    check_index(slot_mapping, "slot_mapping", 1, device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    return StoreKvArgs(src_code, cache_code, k_stride, v_stride, num_tokens, num_kv_heads, head_dim,
                       tokens_per_block)


@dataclass
class AttentionArgs:
    q_code: int
    cache_code: int
    query_stride: int
    out: torch.Tensor
    out_stride: int
    num_tokens: int
    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int


def attention_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   out: torch.Tensor | None, device: torch.device = _CPU,
                   cache_codes: dict | None = None) -> AttentionArgs:
    """The checks every paged_attention shares, its sizes, and `out` (allocated when None)."""
    cache_code = check_cache(k_cache, v_cache, device, cache_codes)
    _num_blocks, num_kv_heads, tokens_per_block, head_dim = k_cache.shape
    q_code = dtype_code(query, "query", device)
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
    return AttentionArgs(q_code, cache_code, q_stride, out, out_stride, num_tokens, num_seqs, num_heads,
                         num_kv_heads, head_dim, tokens_per_block)


def check_softcap(softcap: float) -> float:
    """The attention logit soft-cap as the kernels take it (a float32): 0 (off) or a finite value
    > 0 that float32 holds (a tiny one would round to 0, turning the cap off unnoticed)."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):  # float() would take "3"
        raise ValueError(f"softcap: expected a real number, got {softcap!r}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap: must be finite and >= 0 (0 disables it), got {softcap!r}")
    if cap != 0 and not _F32.tiny <= cap <= _F32.max:
        raise ValueError(f"softcap: {softcap!r} is outside float32's normal range "
                         f"[{_F32.tiny}, {_F32.max}] (0 disables it)")
    return cap


def check_slot_contents(slot_mapping: torch.Tensor, num_blocks: int, tokens_per_block: int) -> None:
    """The slot check the CPU store_kv makes (in C++, ``check_kv_slots``), on a host copy: for the
    CUDA kernels, which trust their indices."""
    slots = _host_int32(slot_mapping)
    _core._check_kv_slots(slots.data_ptr(), slots.numel(), tokens_per_block, num_blocks)


def check_attention_contents(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             num_tokens: int, num_blocks: int, tokens_per_block: int,
                             sliding_window: int = 0) -> None:
    """The index checks the CPU paged_attention makes (in C++, ``check_attention_indices``), on
    host copies: for the CUDA kernels, which trust their indices. Shapes as checked by
    attention_args."""
    qsl, lens, table = _host_int32(query_start_loc), _host_int32(seq_lens), _host_int32(block_tables)
    # the C++ reads num_seqs + 1 offsets and num_seqs table rows: the sizes first
    if lens.dim() != 1 or qsl.shape != (lens.numel() + 1,) or table.dim() != 2 or table.shape[0] < lens.numel():
        raise ValueError(f"query_start_loc/seq_lens/block_tables: shapes {tuple(qsl.shape)}, {tuple(lens.shape)}, "
                         f"{tuple(table.shape)} do not describe [num_seqs + 1], [num_seqs], [>= num_seqs, width]")
    _core._check_attention_indices(qsl.data_ptr(), lens.data_ptr(), table.data_ptr(), lens.numel(), num_tokens,
                                   table.shape[1], tokens_per_block, num_blocks, sliding_window)


def _host_int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(device="cpu", dtype=torch.int32).contiguous()
