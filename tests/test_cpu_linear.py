"""Tests of the CPU bf16 linear kernel (pyengine.layers.linear.linear_bf16) against fp64 and fp32
PyTorch references of the same bf16 inputs, on the AVX-512 and the portable code paths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import pyengine.core._core as _core
from pyengine.layers.cpu_features import cpu_flags
from pyengine.layers.linear import MAX_ROWS, isa, linear_bf16

BF16 = torch.bfloat16
U = 2.0 ** -24  # fp32 unit roundoff


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |v| (8 significant bits), for normal v; 0 maps to the
    smallest normal's spacing."""
    _, e = torch.frexp(v.double().abs().clamp_min(torch.finfo(BF16).tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 8)


def make(m: int, n: int, k: int, seed: int, bias: bool):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = torch.randn(n, k, generator=g).to(BF16)
    b = torch.randn(n, generator=g).to(BF16) if bias else None
    return x, w, b


def check_against_references(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    y = linear_bf16(x, w, b)
    assert y.dtype == BF16 and tuple(y.shape) == (x.shape[0], w.shape[0])
    k = x.shape[1]
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    exact = x.double() @ w.double().T + b64
    # bf16 x bf16 products are exact in fp32; a sum of K products plus the bias in fp32, in any
    # order, is within gamma * sum|terms| of the exact value (gamma = n u / (1 - n u), n = K + 1),
    # and the final rounding to bf16 adds at most half a bf16 ulp of the result.
    terms = x.double().abs() @ w.double().abs().T + b64.abs()
    gamma = (k + 1) * U / (1 - (k + 1) * U)
    err = (y.double() - exact).abs()
    bound = 0.5 * bf16_ulp(y) + gamma * terms
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
    # Against torch's fp32 computation rounded to bf16: only the order of the fp32 additions
    # differs. Its effect (~sqrt(K) u |terms|) is far below a bf16 ulp (2^-8 relative) on these
    # well-conditioned random inputs, so the two roundings differ by at most one bf16 ulp.
    ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(BF16)
    diff = (y.double() - ref.double()).abs()
    assert bool((diff <= bf16_ulp(torch.maximum(y.double().abs(), ref.double().abs()))).all())


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_rows_and_tails(m, bias):
    # N not a multiple of the 8- or 4-row tiles; K with tails after 16 and 32 columns.
    for n, k in [(37, 45), (13, 1537), (8, 32), (3, 7)]:
        check_against_references(*make(m, n, k, seed=100 * m + k, bias=bias))


@pytest.mark.parametrize("m", [1, 4, 15])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (1000, 96)])
def test_model_shapes_parallel(m, n, k):
    # Large enough to be split over threads.
    check_against_references(*make(m, n, k, seed=7 + m, bias=m == 4))


def test_exact_integer_inputs_match_torch_bit_for_bit():
    # Small integers: every product and partial sum is exact in fp32, so the only rounding is
    # the final one to bf16 (sums above 256 need it, with ties): round to nearest even.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (5, 301), generator=g).to(BF16)
    w = torch.randint(-4, 5, (67, 301), generator=g).to(BF16)
    b = torch.randint(-300, 301, (67,), generator=g).to(BF16)
    ref = F.linear(x.float(), w.float(), b.float())
    assert bool((ref.abs() > 256).any())  # the rounding is exercised
    assert torch.equal(linear_bf16(x, w, b), ref.to(BF16))


def test_nan_and_inf_propagate():
    x, w, _ = make(2, 20, 40, seed=5, bias=False)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    w[:, 0] = 1.0
    y = linear_bf16(x, w)
    assert bool(y[0].isnan().all())
    assert bool((y[1] == float("inf")).all())


def test_out_argument_is_written_and_returned():
    x, w, b = make(3, 50, 64, seed=9, bias=True)
    out = torch.full((3, 50), 123.0, dtype=BF16)
    assert linear_bf16(x, w, b, out=out) is out
    assert torch.equal(out, linear_bf16(x, w, b))


def test_lm_head_view_of_embedding():
    # The tied lm_head is the embedding table itself: [vocab, hidden], contiguous.
    x, w, _ = make(1, 32000, 64, seed=11, bias=False)
    check_against_references(x, w, None)


# ---------------------------------------------------------------------------------------------
# code paths
# ---------------------------------------------------------------------------------------------


def test_isa_follows_cpu_and_environment():
    disabled = os.environ.get("PYENGINE_DISABLE_AVX512", "") not in ("", "0")
    flags = cpu_flags()
    has = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    assert isa() == ("avx512" if has and not disabled else "generic")


def test_generic_path_in_subprocess():
    """The same tests with PYENGINE_DISABLE_AVX512=1 (the portable build of the inner loop)."""
    if os.environ.get("PYENGINE_DISABLE_AVX512", "") not in ("", "0"):
        pytest.skip("already running with AVX-512 disabled")
    env = dict(os.environ, PYENGINE_DISABLE_AVX512="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                        "-k", "not generic_path_in_subprocess"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,name", [
    ("x_dtype", "x"), ("w_dtype", "weight"), ("b_dtype", "bias"), ("x_noncontig", "x"),
    ("w_noncontig", "weight"), ("x_dims", "x"), ("w_k", "weight"), ("no_rows", "x"),
    ("too_many_rows", "x"), ("b_shape", "bias"), ("out_shape", "out"), ("out_dtype", "out"),
])
def test_argument_errors_name_the_argument(case, name):
    x, w, b = make(2, 10, 24, seed=1, bias=True)
    out = None
    if case == "x_dtype":
        x = x.float()
    elif case == "w_dtype":
        w = w.half()
    elif case == "b_dtype":
        b = b.float()
    elif case == "x_noncontig":
        x = make(2, 10, 48, seed=1, bias=False)[0][:, ::2]
    elif case == "w_noncontig":
        w = make(2, 24, 10, seed=1, bias=False)[1].T
    elif case == "x_dims":
        x = x[0]
    elif case == "w_k":
        w = w[:, :20].contiguous()
    elif case == "no_rows":
        x = x[:0]
    elif case == "too_many_rows":
        x = torch.zeros(MAX_ROWS + 1, 24, dtype=BF16)
    elif case == "b_shape":
        b = b[:9]
    elif case == "out_shape":
        out = torch.empty(2, 11, dtype=BF16)
    elif case == "out_dtype":
        out = torch.empty(2, 10, dtype=torch.float32)
    with pytest.raises(ValueError, match=f"^{name}:"):
        linear_bf16(x, w, b, out=out)


@pytest.mark.parametrize("args,name", [
    ((0, 1, 1, 0, 1, 1, 1, 1), "y"),
    ((1, 0, 1, 0, 1, 1, 1, 1), "x"),
    ((1, 1, 0, 0, 1, 1, 1, 1), "weight"),
    ((1, 1, 1, 0, 0, 1, 1, 1), "M"),
    ((1, 1, 1, 0, MAX_ROWS + 1, 1, 1, 1), "M"),
    ((1, 1, 1, 0, 1, 0, 1, 1), "N"),
    ((1, 1, 1, 0, 1, 1, -3, 1), "K"),
])
def test_core_validates_arguments(args, name):
    # The C++ entry point checks before touching memory (these addresses are never read).
    with pytest.raises(ValueError, match=f"^{name}:"):
        _core._linear_bf16(*args)
