"""Tests of the CPU linear kernels (pyengine.layers.linear.linear_bf16 / linear_f32) against fp64
and fp32 PyTorch references of the same inputs, at every instruction-set level this CPU has (the
`cpu_isa` fixture of conftest.py, used by every test of results)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pyengine.core._core as _core
from pyengine.layers.linear import MAX_ROWS, linear_bf16, linear_f32

BF16 = torch.bfloat16
U = 2.0 ** -24  # fp32 unit roundoff
LINEAR = {BF16: linear_bf16, torch.float32: linear_f32}
DTYPES = pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "fp32"])


def bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |v| (8 significant bits), for normal v; 0 maps to the
    smallest normal's spacing."""
    _, e = torch.frexp(v.double().abs().clamp_min(torch.finfo(BF16).tiny))
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 8)


def make(m: int, n: int, k: int, seed: int, bias: bool, dtype: torch.dtype = BF16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def check_against_references(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    y = LINEAR[x.dtype](x, w, b)
    assert y.dtype == x.dtype and tuple(y.shape) == (x.shape[0], w.shape[0])
    k = x.shape[1]
    b64 = torch.zeros(w.shape[0], dtype=torch.float64) if b is None else b.double()
    exact = x.double() @ w.double().T + b64
    terms = x.double().abs() @ w.double().abs().T + b64.abs()
    err = (y.double() - exact).abs()
    if x.dtype == BF16:
        # bf16 x bf16 products are exact in fp32; a sum of K products plus the bias in fp32, in
        # any order, is within gamma * sum|terms| of the exact value (gamma = n u / (1 - n u),
        # n = K + 1), and the final rounding to bf16 adds at most half a bf16 ulp of the result.
        gamma = (k + 1) * U / (1 - (k + 1) * U)
        bound = 0.5 * bf16_ulp(y) + gamma * terms
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"
        # Against torch's fp32 computation rounded to bf16: only the order of the fp32 additions
        # differs, so both sums lie within gamma * terms of the exact one and each rounding adds
        # half an ulp. Where a result cancels to near zero the order alone can move it by more
        # than its own ulp (torch's sgemm sums in another order on AVX-512 than on AVX2), hence
        # the gamma term rather than "one ulp" alone.
        ref = F.linear(x.float(), w.float(), None if b is None else b.float()).to(BF16)
        diff = (y.double() - ref.double()).abs()
        ulp = bf16_ulp(torch.maximum(y.double().abs(), ref.double().abs()))
        assert bool((diff <= ulp + 2 * gamma * terms).all()), f"max excess {(diff - ulp - 2 * gamma * terms).max().item()}"
    else:
        # fp32: each product rounds too (or fuses with its addition), so n = K + 2 roundings.
        gamma = (k + 2) * U / (1 - (k + 2) * U)
        assert bool((err <= gamma * terms).all()), f"max excess {(err - gamma * terms).max().item()}"
        ref = F.linear(x, w, b)  # torch's order of additions: both within the bound of exact
        assert bool(((y.double() - ref.double()).abs() <= 2 * gamma * terms).all())


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("m", [*range(1, 17), 31, 32, 33, MAX_ROWS - 1, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_rows_and_tails(m, bias, dtype, cpu_isa):
    # N not a multiple of the 4-row tiles; K with tails after 8, 16 and 32 columns.
    for n, k in [(37, 45), (13, 1537), (8, 32), (3, 7), (5, 70)]:
        check_against_references(*make(m, n, k, seed=100 * m + k, bias=bias, dtype=dtype))


@DTYPES
@pytest.mark.parametrize("m", [1, 4, 15])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (1000, 96)])
def test_model_shapes_parallel(m, n, k, dtype, cpu_isa):
    # Large enough to be split over threads.
    check_against_references(*make(m, n, k, seed=7 + m, bias=m == 4, dtype=dtype))


def test_unaligned_weight_view_at_the_end_of_its_buffer(cpu_isa):
    # Weight rows at an odd offset inside a larger buffer, the last one ending where the buffer
    # ends; K not a multiple of any vector width (the row tails).
    for dtype in (BF16, torch.float32):
        x, w, b = make(3, 9, 37, seed=2, bias=True, dtype=dtype)
        big = torch.zeros(10 * 37 + 9 * 37, dtype=dtype)
        big[-9 * 37:] = w.flatten()
        check_against_references(x, big[-9 * 37:].view(9, 37), b)


def test_exact_integer_inputs_match_torch_bit_for_bit(cpu_isa):
    # Small integers: every product and partial sum is exact in fp32, so the only rounding is
    # the final one to bf16 (sums above 256 need it, with ties): round to nearest even. In fp32
    # there is no rounding at all.
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (5, 301), generator=g).to(BF16)
    w = torch.randint(-4, 5, (67, 301), generator=g).to(BF16)
    b = torch.randint(-300, 301, (67,), generator=g).to(BF16)
    ref = F.linear(x.float(), w.float(), b.float())
    assert bool((ref.abs() > 256).any())  # the rounding is exercised
    assert torch.equal(linear_bf16(x, w, b), ref.to(BF16))
    assert torch.equal(linear_f32(x.float(), w.float(), b.float()), ref)


@pytest.mark.parametrize("cpu_isa", ["avx512"], indirect=True)
def test_rows_do_not_depend_on_the_rows_batched_with_them(cpu_isa):
    """AVX-512: from M == 2 on (tiles), every output is the same sum in the same order whatever
    M is, so a row batched with others gives bit for bit what it gives in any other batch of 2
    or more -- speculative decoding's extra rows, and a request's batch neighbours, leave its
    logits unchanged. (M == 1 reads a row at a time, in another order.)"""
    for dtype, ms in ((torch.float32, (2, 3, 4, 5, 8, 9, 16)), (BF16, (2, 3, 4, 5, 8, 9, 16))):
        x, w, b = make(16, 203, 577, seed=11, bias=True, dtype=dtype)
        # each row in a batch of two (with row 0)
        alone = torch.cat([LINEAR[dtype](torch.cat([x[i: i + 1], x[:1]]), w, b)[:1] for i in range(16)])
        for m in ms:
            assert torch.equal(LINEAR[dtype](x[:m], w, b), alone[:m]), f"{dtype} M={m}"


@DTYPES
def test_nan_and_inf_propagate(dtype, cpu_isa):
    x, w, _ = make(2, 20, 40, seed=5, bias=False, dtype=dtype)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    w[:, 0] = 1.0
    y = LINEAR[dtype](x, w)
    assert bool(y[0].isnan().all())
    assert bool((y[1] == float("inf")).all())


@DTYPES
def test_out_argument_is_written_and_returned(dtype, cpu_isa):
    x, w, b = make(3, 50, 64, seed=9, bias=True, dtype=dtype)
    out = torch.full((3, 50), 123.0, dtype=dtype)
    assert LINEAR[dtype](x, w, b, out=out) is out
    assert torch.equal(out, LINEAR[dtype](x, w, b))


@DTYPES
def test_lm_head_view_of_embedding(dtype, cpu_isa):
    # The tied lm_head is the embedding table itself: [vocab, hidden], contiguous.
    x, w, _ = make(1, 32000, 64, seed=11, bias=False, dtype=dtype)
    check_against_references(x, w, None)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,name", [
    ("x_dtype", "x"), ("w_dtype", "weight"), ("b_dtype", "bias"), ("x_noncontig", "x"),
    ("w_noncontig", "weight"), ("x_dims", "x"), ("w_k", "weight"), ("no_rows", "x"),
    ("too_many_rows", "x"), ("b_shape", "bias"), ("out_shape", "out"), ("out_dtype", "out"),
])
@DTYPES
def test_argument_errors_name_the_argument(case, name, dtype):
    x, w, b = make(2, 10, 24, seed=1, bias=True, dtype=dtype)
    other = torch.float32 if dtype == BF16 else BF16
    out = None
    if case == "x_dtype":
        x = x.to(other)
    elif case == "w_dtype":
        w = w.half()
    elif case == "b_dtype":
        b = b.to(other)
    elif case == "x_noncontig":
        x = make(2, 10, 48, seed=1, bias=False, dtype=dtype)[0][:, ::2]
    elif case == "w_noncontig":
        w = make(2, 24, 10, seed=1, bias=False, dtype=dtype)[1].T
    elif case == "x_dims":
        x = x[0]
    elif case == "w_k":
        w = w[:, :20].contiguous()
    elif case == "no_rows":
        x = x[:0]
    elif case == "too_many_rows":
        x = torch.zeros(MAX_ROWS + 1, 24, dtype=dtype)
    elif case == "b_shape":
        b = b[:9]
    elif case == "out_shape":
        out = torch.empty(2, 11, dtype=dtype)
    elif case == "out_dtype":
        out = torch.empty(2, 10, dtype=other)
    with pytest.raises(ValueError, match=f"^{name}:"):
        LINEAR[dtype](x, w, b, out=out)


@pytest.mark.parametrize("args,name", [
    ((0, 1, 1, 0, 1, 1, 1, 1), "y"),
    ((1, 0, 1, 0, 1, 1, 1, 1), "x"),
    ((1, 1, 0, 0, 1, 1, 1, 1), "weight"),
    ((1, 1, 1, 0, 0, 1, 1, 1), "M"),
    ((1, 1, 1, 0, MAX_ROWS + 1, 1, 1, 1), "M"),
    ((1, 1, 1, 0, 1, 0, 1, 1), "N"),
    ((1, 1, 1, 0, 1, 1, -3, 1), "K"),
])
@pytest.mark.parametrize("kernel", [_core._linear_bf16, _core._linear_f32], ids=["bf16", "fp32"])
def test_core_validates_arguments(args, name, kernel):
    # The C++ entry point checks before touching memory (these addresses are never read).
    with pytest.raises(ValueError, match=f"^{name}:"):
        kernel(*args)


@DTYPES
@pytest.mark.parametrize("m", [1, 3])
def test_thread_counts_give_the_same_bits(m, dtype, cpu_isa):
    # Threads share the columns in chunks and take over a slower thread's remaining share: which
    # thread computes a column (and how many threads there are) does not change its bits.
    x, w, b = make(m, 3000, 1024, seed=31 + m, bias=True, dtype=dtype)
    fn = linear_bf16 if dtype == BF16 else linear_f32
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs.extend(fn(x, w, b) for _ in range(3))
    finally:
        torch.set_num_threads(old)
    for y in outs[1:]:
        assert torch.equal(y, outs[0])
