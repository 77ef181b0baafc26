"""Tests of pyengine's CPU GEMM (pyengine.layers.linear.gemm_f32 / gemm_bf16) against fp64 and
torch references, at every instruction-set level this CPU has (the `cpu_isa` fixture), and of
`dense`'s routing to it: fp32 and emulated-bf16 batches of GEMM_MIN_ROWS rows or more at the avx2
and avx512 levels (fewer: the decode kernels), torch's GEMM past the decode kernels' rows at the
portable level and with exact_fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pyengine.layers.linear as linear_layer
from pyengine.layers.cpu_features import FAST_FP32_MAX_ROWS
from pyengine.layers.linear import GEMM_MIN_ROWS, cpu_gemm_routed, dense, gemm_bf16, gemm_f32

BF16 = torch.bfloat16
U = 2.0 ** -24  # fp32 unit roundoff
SHAPES = [(17, 37, 45), (33, 13, 1537), (64, 96, 576), (257, 131, 300), (1, 5, 7), (100, 1, 64)]


def make(m: int, n: int, k: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
            torch.randn(n, generator=g).to(dtype))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_fp32_within_the_sum_bound(cpu_isa, shape, bias):
    m, n, k = shape
    x, w, b = make(m, n, k, seed=m + n + k, dtype=torch.float32)
    b = b if bias else None
    y = gemm_f32(x, w, b)
    assert y.dtype == torch.float32 and tuple(y.shape) == (m, n)
    b64 = torch.zeros(n, dtype=torch.float64) if b is None else b.double()
    exact = x.double() @ w.double().T + b64
    terms = x.double().abs() @ w.double().abs().T + b64.abs()
    gamma = (k + 2) * U / (1 - (k + 2) * U)  # K products and K + 1 additions, in any order
    assert bool(((y.double() - exact).abs() <= gamma * terms).all())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_is_the_fp32_sum_rounded(cpu_isa, shape):
    """bf16 products are exact in fp32: the result is an fp32 sum within gamma * terms of the
    exact one, rounded to bf16 once -- and differs from torch's fp32 GEMM on the converted values
    only by the order of the additions."""
    m, n, k = shape
    x, w, b = make(m, n, k, seed=2 * m + n, dtype=BF16)
    y = gemm_bf16(x, w, b)
    assert y.dtype == BF16 and tuple(y.shape) == (m, n)
    exact = x.double() @ w.double().T + b.double()
    terms = x.double().abs() @ w.double().abs().T + b.double().abs()
    gamma = (k + 1) * U / (1 - (k + 1) * U)
    _, e = torch.frexp(y.double().abs().clamp_min(torch.finfo(BF16).tiny))
    half_ulp = torch.ldexp(torch.ones_like(y, dtype=torch.float64), e - 9)
    assert bool(((y.double() - exact).abs() <= half_ulp + gamma * terms).all())
    ref = F.linear(x.float(), w.float(), b.float()).to(BF16)
    assert (y == ref).float().mean().item() > 0.9  # most results round the same way


def test_rows_are_independent_of_the_batch(cpu_isa):
    x, w, b = make(70, 45, 300, seed=3, dtype=torch.float32)
    y = gemm_f32(x, w, b)
    for rows in (slice(0, 1), slice(17, 18), slice(20, 53), slice(69, 70)):
        assert torch.equal(gemm_f32(x[rows].contiguous(), w, b), y[rows])


def test_writes_into_out(cpu_isa):
    x, w, b = make(20, 9, 33, seed=4, dtype=torch.float32)
    out = torch.full((20, 9), float("nan"))
    assert gemm_f32(x, w, b, out=out) is out
    assert torch.equal(out, gemm_f32(x, w, b))


def test_bad_arguments_name_the_argument():
    x, w, b = make(20, 9, 33, seed=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="x: must have at least 1 row, got 0"):
        gemm_f32(x[:0], w)
    with pytest.raises(ValueError, match=r"weight: expected shape \[N, 33\]"):
        gemm_f32(x, w[:, :10].contiguous())
    with pytest.raises(ValueError, match="x: dtype must be torch.float32"):
        gemm_f32(x.to(BF16), w)
    with pytest.raises(ValueError, match=r"bias: expected shape \(9,\)"):
        gemm_f32(x, w, b[:3])
    with pytest.raises(ValueError, match="x: must be contiguous"):
        gemm_f32(x.T, w[:, :20].contiguous())
    with pytest.raises(ValueError, match=r"out: expected shape \(20, 9\)"):
        gemm_f32(x, w, out=torch.empty(9, 20))


def _spy(monkeypatch):
    calls: list[str] = []
    for name in ("gemm_f32", "gemm_bf16", "linear_f32", "linear_bf16"):
        real = getattr(linear_layer, name)
        monkeypatch.setattr(linear_layer, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    real_torch = linear_layer.F.linear
    monkeypatch.setattr(linear_layer.F, "linear", lambda *a, **k: calls.append("torch") or real_torch(*a, **k))
    return calls


def test_dense_routes_large_batches_to_the_gemm_at_avx2_and_avx512(cpu_isa, monkeypatch):
    calls = _spy(monkeypatch)
    routed = cpu_isa in ("avx2", "avx512")
    assert cpu_gemm_routed() == routed
    assert GEMM_MIN_ROWS == 13 and GEMM_MIN_ROWS <= FAST_FP32_MAX_ROWS
    x, w, b = make(FAST_FP32_MAX_ROWS + 1, 24, 64, seed=6, dtype=torch.float32)
    y = dense(x, w, b, fast_fp32=True)
    assert calls == ["gemm_f32" if routed else "torch"]
    ref = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    calls.clear()
    dense(x[:GEMM_MIN_ROWS], w, b, fast_fp32=True)  # within linear_f32's rows: the GEMM from here
    assert calls == ["gemm_f32" if routed else "linear_f32"]
    calls.clear()
    dense(x[:GEMM_MIN_ROWS - 1], w, b, fast_fp32=True)
    assert calls == ["linear_f32"]
    calls.clear()
    dense(x, w, b, fast_fp32=False)  # exact_fp32: torch's rounding
    assert calls == ["torch"]
    calls.clear()
    xh, wh, bh = make(65, 24, 64, seed=7, dtype=BF16)
    dense(xh, wh, bh, emulate_bf16=True, bf16_kernel_max_rows=64)
    assert calls == ["gemm_bf16" if routed else "torch"]
    calls.clear()
    dense(xh[:64], wh, bh, emulate_bf16=True, bf16_kernel_max_rows=64)
    assert calls == ["gemm_bf16" if routed else "linear_bf16"]
    calls.clear()
    dense(xh[:GEMM_MIN_ROWS], wh, bh, emulate_bf16=True, bf16_kernel_max_rows=64)
    assert calls == ["gemm_bf16" if routed else "linear_bf16"]
    calls.clear()
    dense(xh[:GEMM_MIN_ROWS - 1], wh, bh, emulate_bf16=True, bf16_kernel_max_rows=64)
    assert calls == ["linear_bf16"]
    calls.clear()
    dense(xh[:GEMM_MIN_ROWS], wh, bh, bf16_kernel_max_rows=64)  # native bf16: never the fp32 GEMM
    assert calls == ["linear_bf16"]
