"""Torch-facing fused elementwise CPU kernels: RMSNorm (with the residual add
before it), rotary embedding in place, SiLU·mul; float32, bfloat16 or float16.

Each equals the sequence of torch operations it replaces in ``pyengine/models/llama.py`` (same
order, same roundings to the activation dtype; the RMSNorm's sum of squares may differ in the
last fp32 bit, so its output by one unit in the last place at most) — see
``csrc/include/pyengine/cpu_elementwise.h``. At a handful of rows a decode step's time goes to
the per-call overhead of those small operations, so these calls keep the checks to metadata.
"""

from __future__ import annotations

import torch

import pyengine.core._core as _core
from pyengine.layers._kernel_checks import DTYPE_CODES, dtype_code

__all__ = ["rms_norm", "add_rms_norm", "rotary_embedding_", "silu_mul", "SUPPORTED_DTYPES", "MAX_ROWS"]

SUPPORTED_DTYPES = tuple(DTYPE_CODES)

#: The models run these kernels at every size, except that with ``exact_fp32`` batches of more
#: than this many rows keep torch's RMSNorm, RoPE and SiLU·mul.
MAX_ROWS = 15


def _check(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype} differs from {dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name}: must be a CPU tensor, got device {t.device}")


def _rows_2d(t: torch.Tensor, name: str, width: int) -> int:
    """Row stride of a [rows, width] tensor whose rows are contiguous."""
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"{name}: expected shape [rows, {width}], got {tuple(t.shape)}")
    if t.stride(1) != 1 and width > 1:
        raise ValueError(f"{name}: rows must be contiguous, strides {t.stride()}")
    return t.stride(0) if t.shape[0] > 1 else width


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` for x [rows, hidden]."""
    code = dtype_code(x, "x")
    hidden = weight.shape[0]
    _check(weight, "weight", x.dtype)
    stride = _rows_2d(x, "x", hidden)
    out = torch.empty(x.shape, dtype=x.dtype)
    _core._rms_norm(out.data_ptr(), hidden, x.data_ptr(), stride, 0, hidden, weight.data_ptr(), code,
                    x.shape[0], hidden, float(eps), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (in place, rounded to the dtype), then returns ``rms_norm(residual)``."""
    code = dtype_code(x, "x")
    hidden = weight.shape[0]
    _check(weight, "weight", x.dtype)
    _check(residual, "residual", x.dtype)
    x_stride = _rows_2d(x, "x", hidden)
    r_stride = _rows_2d(residual, "residual", hidden)
    if residual.shape[0] != x.shape[0]:
        raise ValueError(f"residual: {residual.shape[0]} rows, x has {x.shape[0]}")
    out = torch.empty(x.shape, dtype=x.dtype)
    _core._rms_norm(out.data_ptr(), hidden, x.data_ptr(), x_stride, residual.data_ptr(), r_stride,
                    weight.data_ptr(), code, x.shape[0], hidden, float(eps), torch.get_num_threads())
    return out


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """In place on x [tokens, heads, head_dim] (heads contiguous in a row):
    ``x = x * cos[positions] + rotate_half(x) * sin[positions]`` with each product and the sum
    rounded to the dtype; cos/sin are contiguous [max_position, head_dim] tables."""
    code = dtype_code(x, "x")
    if x.dim() != 3:
        raise ValueError(f"x: expected 3 dims [tokens, heads, head_dim], got {tuple(x.shape)}")
    tokens, heads, head_dim = x.shape
    if x.stride(2) != 1 or x.stride(1) != head_dim:
        raise ValueError(f"x: heads and head_dim must be contiguous, strides {x.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(t, name, x.dtype)
        if t.dim() != 2 or t.shape[1] != head_dim or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous [max_position, {head_dim}] table, "
                             f"got {tuple(t.shape)}")
    if positions.dtype != torch.int32 or not positions.is_contiguous() or positions.shape != (tokens,):
        raise ValueError(f"positions: expected contiguous int32 [{tokens}], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    stride = x.stride(0) if tokens > 1 else heads * head_dim
    _core._rotary_embedding(x.data_ptr(), stride, tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                            cos.shape[0], positions.data_ptr(), code, torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate_up = cat([gate, up], -1) [rows, 2 * inter], contiguous."""
    code = dtype_code(gate_up, "gate_up")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(f"gate_up: expected a contiguous [rows, 2 * inter] tensor, got {tuple(gate_up.shape)}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    _core._silu_mul(out.data_ptr(), gate_up.data_ptr(), code, rows, inter, torch.get_num_threads())
    return out
