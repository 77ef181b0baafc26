"""Linear layers: `dense` routes a matmul to the fastest path for its dtype and row count;
`linear_bf16` and `linear_f32` are pyengine's GEMV / small-M GEMM for few-row (decode) batches,
which stream the weights at memory speed where torch's batch-1 matmul does not (emulated bf16 on
CPUs without bf16 instructions; fp32 GEMV at a fraction of the memory bandwidth).

``linear_bf16(x, weight, bias)`` equals ``F.linear(x.float(), weight.float(),
bias.float()).to(torch.bfloat16)`` up to the order of the fp32 additions: exact bf16 products,
fp32 accumulation, the result rounded to nearest even. ``linear_f32`` equals ``F.linear`` in
fp32 up to the order of the additions. Both read the weight once for all rows of ``x`` (1 to
``MAX_ROWS``), in parallel over output columns, without the GIL, with the compute code of the
active instruction-set level (``pyengine.cpu_info()``; ``csrc/kernels/cpu/linear*.cpp``). The
checks here only read metadata: they run once per linear layer per decode step.

``gemm_f32`` and ``gemm_bf16`` are pyengine's GEMM for any number of rows (prefill, large decode
batches): compute-bound, x packed in panels and each weight element broadcast against them
(``csrc/kernels/cpu/gemm*.cpp``); every output one fp32 sum over k in order, so a row's result
does not depend on the rows batched with it. At the avx2 and avx512 levels ``dense`` takes them
for fp32 and emulated-bf16 batches of ``GEMM_MIN_ROWS`` (13) rows or more: measured on a 2-core
AMD EPYC (Zen 5) they multiply 1.9-5.0x (avx512) and 1.15-1.9x (avx2) faster than torch's sgemm
from 17 to 2048 rows (bench/gemm.py), and on an Intel Xeon 1.1-1.5x faster than ``linear_f32`` /
``linear_bf16`` from 14 rows (even at 12-13; from DRAM, as in a model's forward). At the portable
level torch's GEMM is faster and stays.
"""

from __future__ import annotations

import torch

import torch.nn.functional as F

import pyengine.core._core as _core
from pyengine.layers.cpu_features import FAST_FP32_MAX_ROWS
from pyengine.quant import QuantizedWeight

__all__ = ["dense", "gemm_bf16", "gemm_f32", "linear_bf16", "linear_f32", "MAX_ROWS", "GEMM_MIN_ROWS",
           "cpu_gemm_routed"]

#: Most rows of ``x`` that one call takes.
MAX_ROWS: int = _core.LINEAR_MAX_ROWS

_KERNELS = {torch.bfloat16: _core._linear_bf16, torch.float32: _core._linear_f32}
_GEMMS = {torch.bfloat16: _core._gemm_bf16, torch.float32: _core._gemm_f32}
#: From this many rows ``dense`` takes the GEMM where ``cpu_gemm_routed()`` (the C++ one-call
#: decode path switches at the same count: csrc/include/pyengine/cpu_gemm.h).
GEMM_MIN_ROWS: int = _core.GEMM_MIN_ROWS


def cpu_gemm_routed() -> bool:
    """Whether ``dense`` sends fp32 (and emulated-bf16) batches of GEMM_MIN_ROWS rows or more to
    pyengine's GEMM: at the avx2 and avx512 levels (the active one, read each call, so
    set_cpu_isa() takes effect at once; faster than torch's GEMM there, measured only on x86)."""
    return _core._gemm_routed()


def _check(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype must be {dtype}, got {t.dtype}")
    if not t.is_cpu:
        raise ValueError(f"{name}: must be a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None,
            dtype: torch.dtype, gemm: bool = False) -> torch.Tensor:
    _check(x, "x", dtype)
    _check(weight, "weight", dtype)
    if x.dim() != 2:
        raise ValueError(f"x: expected 2 dims [M, K], got {tuple(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected 2 dims [N, K], got {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected shape [N, {k}] for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if gemm:
        if m < 1:
            raise ValueError(f"x: must have at least 1 row, got {m}")
    elif not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x: must have 1..{MAX_ROWS} rows, got {m}")
    bias_ptr = 0
    if bias is not None:
        _check(bias, "bias", dtype)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias: expected shape ({n},), got {tuple(bias.shape)}")
        bias_ptr = bias.data_ptr()
    if out is None:
        out = torch.empty((m, n), dtype=dtype)
    else:
        _check(out, "out", dtype)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"out: expected shape ({m}, {n}), got {tuple(out.shape)}")
    (_GEMMS if gemm else _KERNELS)[dtype](out.data_ptr(), x.data_ptr(), weight.data_ptr(), bias_ptr, m, n, k,
                                          torch.get_num_threads())
    return out


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[M, N] = x[M, K] @ weight[N, K].T (+ bias[N])``, all bf16, contiguous, on the CPU;
    1 <= M <= MAX_ROWS. Writes into ``out`` ([M, N]) when given. Raises ValueError naming the
    bad argument."""
    return _linear(x, weight, bias, out, torch.bfloat16)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """As `linear_bf16`, all fp32."""
    return _linear(x, weight, bias, out, torch.float32)


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """As `linear_bf16` for any number of rows (M >= 1): pyengine's GEMM."""
    return _linear(x, weight, bias, out, torch.bfloat16, gemm=True)


def gemm_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """As `linear_f32` for any number of rows (M >= 1): pyengine's GEMM."""
    return _linear(x, weight, bias, out, torch.float32, gemm=True)


def dense(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
          emulate_bf16: bool = False, fast_fp32: bool = False, bf16_kernel_max_rows: int = 0) -> torch.Tensor:
    """``F.linear(x, weight, bias)``. bf16 weights on the CPU: batches of 1 to
    `bf16_kernel_max_rows` rows go through `linear_bf16` (fp32 accumulation of the exact products,
    the output rounded to bf16), which streams the weights at memory speed; with `emulate_bf16`
    (a CPU without bf16 instructions, where torch's bf16 GEMM is emulated and slow) larger batches
    take an fp32 matmul on the bf16 values (the same rounding). With `fast_fp32` (fp32 weights on
    the CPU), batches of at most FAST_FP32_MAX_ROWS rows go through `linear_f32` (the same sums in
    another order). Where `cpu_gemm_routed()`, fp32 and emulated-bf16 batches of GEMM_MIN_ROWS
    rows or more take `gemm_f32` / `gemm_bf16` instead (faster than the decode kernels from
    there), else the larger ones torch's GEMM. A QuantizedWeight computes in fp32 (x quantized to
    8 bits per block on the fly) at any row count; the result is returned in x's dtype."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias).to(x.dtype)
    rows = x.shape[0]
    gemm = (fast_fp32 or emulate_bf16) and _core._gemm_preferred(rows)  # the one-call decode path's rule
    if fast_fp32 and rows > 0:
        if gemm:
            return gemm_f32(x.contiguous(), weight, bias)
        if rows <= FAST_FP32_MAX_ROWS:
            return linear_f32(x.contiguous(), weight, bias)
    if gemm and emulate_bf16:
        return gemm_bf16(x.contiguous(), weight, bias)
    if 0 < rows <= bf16_kernel_max_rows:
        return linear_bf16(x.contiguous(), weight, bias)
    if emulate_bf16 and rows > 0:
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    return F.linear(x, weight, bias)
