"""Argument checks shared by the torch-facing kernel modules (``pyengine.kernels`` on the CPU,
``pyengine.cuda_kernels`` on CUDA devices).

Only cheap metadata reads (dtype, device, shape, strides): nothing here reads tensor contents,
so nothing synchronizes with a device. Every error is a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch

#: torch dtype -> C++ ``pyengine::kernels::DType`` value of the activation dtypes.
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_CPU = torch.device("cpu")


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
