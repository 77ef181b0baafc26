"""The GPU's weight-only quantized linear layer (QuantizedWeight.to("cuda").linear: the GEMV kernel
of csrc/kernels/cuda/linear_quant.cu up to CUDA_GEMV_MAX_ROWS rows of x, the weights dequantized
chunk by chunk into torch's GEMM beyond) against an fp64 reference over the same dequantized
weights, for every block format, activation dtype and row count on both sides of the switch;
the embedding lookup and dequantization on the GPU; needs a GPU."""

from __future__ import annotations

import pytest
import torch

import pyengine.core._core as _core
import pyengine.quant.weight as quant_weight
from pyengine.quant import QUANT_FORMATS, QuantizedWeight
from pyengine.quant.formats import INTERLEAVED_LAYOUTS

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _core._cuda_kernels_built(), reason="pyengine was built without its CUDA kernels"),
]

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def check_linear(gpu: QuantizedWeight, w: torch.Tensor, dtype: torch.dtype, rows, g: torch.Generator,
                 what: str, with_bias: bool = True) -> None:
    """gpu.linear on `rows` rows of x against x @ w.T (+ bias) in fp64: fp32 sums over K
    products, then one rounding to dtype."""
    n, k = w.shape
    bias = torch.randn(n, generator=g) if with_bias else None
    for m in rows:
        # beyond the GEMV's rows the GEMM multiplies the weights rounded to 16-bit x's dtype: one
        # more relative rounding per product
        weights_rounded = m > quant_weight.CUDA_GEMV_MAX_ROWS and dtype != torch.float32
        x = torch.randn(m, k, generator=g).to(dtype)
        y = gpu.linear(x.cuda(), None if bias is None else bias.cuda())
        assert y.dtype == dtype and y.shape == (m, n)
        b = torch.zeros(n, dtype=torch.float64) if bias is None else bias.to(dtype).double()
        exact = x.double() @ w.T + b
        terms = x.double().abs() @ w.abs().T + b.abs()
        bound = ((k + 2) * 2.0 ** -24 + (U[dtype] if weights_rounded else 0.0)) * terms \
            + U[dtype] * exact.abs() + 1e-30
        err = (y.cpu().double() - exact).abs()
        assert bool((err <= bound).all()), f"{what} {dtype} M={m}: max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_linear_matches_fp64_reference(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    n, k = 44, 768
    q = QuantizedWeight.quantize(torch.randn(n, k, generator=g), fmt).interleaved()  # the CPU's layout ...
    gpu = q.to("cuda")  # ... goes to the GPU as llama.cpp's
    assert gpu.layouts == [fmt] and gpu.device.type == "cuda"
    assert quant_weight.CUDA_GEMV_MAX_ROWS == 2
    w = q.dequantize().double()
    # the GEMV kernel up to 2 rows, the dequantized weights and torch's GEMM from 3
    check_linear(gpu, w, dtype, (1, 2, 3, 8, 17, 64), g, fmt)
    # the GEMV kernel's own passes of 8 rows (its path forced: it serves any row count)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quant_weight, "CUDA_GEMV_MAX_ROWS", 1 << 30)
        check_linear(gpu, w, dtype, (3, 8, 9, 17), g, fmt + " (GEMV)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_linear_of_row_groups_and_small_chunks(dtype, monkeypatch):
    """A weight of three row groups (Q8_0, Q4_K, Q6_K: a GGUF file's fused qkv) through both
    paths, the GEMM path with chunks of 5 rows that straddle the groups (its output columns
    then strided), with and without a bias."""
    g = torch.Generator().manual_seed(1)
    k = 512
    parts = [QuantizedWeight.quantize(torch.randn(n, k, generator=g), fmt)
             for n, fmt in ((12, "q8_0"), (7, "q4_k"), (9, "q6_k"))]
    q = QuantizedWeight.cat(parts)
    gpu = q.to("cuda")
    assert gpu.formats == ["q8_0", "q4_k", "q6_k"]
    monkeypatch.setattr(quant_weight, "CUDA_DEQUANT_CHUNK_ELEMS", 5 * k)
    w = q.dequantize().double()
    check_linear(gpu, w, dtype, (1, 2, 5, 8, 13, 40), g, "groups")
    check_linear(gpu, w, dtype, (2, 21), g, "groups, no bias", with_bias=False)


def test_cuda_embedding_and_dequantize_equal_the_cpus():
    g = torch.Generator().manual_seed(2)
    k = 256
    q = QuantizedWeight.cat([QuantizedWeight.quantize(torch.randn(n, k, generator=g), fmt)
                             for n, fmt in ((10, "q4_0"), (6, "q5_0"), (8, "q4_k"))])
    gpu = q.to("cuda")
    cpu_values = q.dequantize()
    scale = cpu_values.abs().max().item()
    # (the same products of block scales and codes; the GPU may fuse a multiply-add)
    assert torch.allclose(gpu.dequantize().cpu(), cpu_values, rtol=0, atol=1e-6 * scale)
    ids = torch.tensor([[0, 23, 9, 10], [16, 15, 5, 23]])
    rows = gpu.embedding(ids.cuda())
    assert rows.shape == (2, 4, k) and rows.dtype == torch.float32 and rows.device.type == "cuda"
    assert torch.allclose(rows.cpu(), q.embedding(ids), rtol=0, atol=1e-6 * scale)
    # no check on the GPU (no synchronization): an id outside the table leaves its row NaN
    out = gpu.embedding(torch.tensor([3, 24, -1], device="cuda")).cpu()
    assert torch.allclose(out[0], q.embedding(torch.tensor([3]))[0], rtol=0, atol=1e-6 * scale)
    assert bool(out[1:].isnan().all())


def test_cuda_linear_rejects_bad_input():
    q = QuantizedWeight.quantize(torch.randn(8, 256), "q4_0").to("cuda")
    with pytest.raises(ValueError, match=r"x: expected shape \[M, 256\], got \(2, 128\)"):
        q.linear(torch.zeros(2, 128, device="cuda"))
    with pytest.raises(ValueError, match=r"x: expected a float32, bfloat16 or float16 tensor on cuda:0, got torch.float32 on cpu"):
        q.linear(torch.zeros(2, 256))
    with pytest.raises(ValueError, match=r"q4_0x8 is a CPU layout; on cuda:0 the weights keep llama.cpp's"):
        QuantizedWeight([(INTERLEAVED_LAYOUTS["q4_0"], torch.zeros(8, 144, dtype=torch.uint8, device="cuda"))], 256)
