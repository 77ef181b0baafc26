"""The GPU's weight-only quantized linear layer (QuantizedWeight.to("cuda").linear, the kernel of
csrc/kernels/cuda/linear_quant.cu) against an fp64 reference over the same dequantized weights,
for every block format, activation dtype and row count up to past two passes of 8 rows; needs a
GPU."""

from __future__ import annotations

import pytest
import torch

import pyengine.core._core as _core
from pyengine.quant import QUANT_FORMATS, QuantizedWeight
from pyengine.quant.formats import INTERLEAVED_LAYOUTS

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not _core._cuda_kernels_built(), reason="pyengine was built without its CUDA kernels"),
]

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


@pytest.mark.parametrize("fmt", list(QUANT_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_linear_matches_fp64_reference(fmt, dtype):
    g = torch.Generator().manual_seed(0)
    n, k = 44, 768
    q = QuantizedWeight.quantize(torch.randn(n, k, generator=g), fmt).interleaved()  # the CPU's layout ...
    gpu = q.to("cuda")  # ... goes to the GPU as llama.cpp's
    assert gpu.layouts == [fmt] and gpu.device.type == "cuda"
    w = q.dequantize().double()
    bias = torch.randn(n, generator=g)
    for m in (1, 3, 8, 17):
        x = torch.randn(m, k, generator=g).to(dtype)
        y = gpu.linear(x.cuda(), bias.cuda())
        assert y.dtype == dtype and y.shape == (m, n)
        b = bias.to(dtype).double()
        exact = x.double() @ w.T + b
        terms = x.double().abs() @ w.abs().T + b.abs()
        # fp32 sums over K products, then one rounding to dtype
        bound = (k + 2) * 2.0 ** -24 * terms + U[dtype] * exact.abs() + 1e-30
        err = (y.cpu().double() - exact).abs()
        assert bool((err <= bound).all()), f"{fmt} {dtype} M={m}: max excess {(err - bound).max().item()}"


def test_cuda_linear_rejects_bad_input():
    q = QuantizedWeight.quantize(torch.randn(8, 256), "q4_0").to("cuda")
    with pytest.raises(ValueError, match=r"x: expected shape \[M, 256\], got \(2, 128\)"):
        q.linear(torch.zeros(2, 128, device="cuda"))
    with pytest.raises(ValueError, match=r"x: expected a float32, bfloat16 or float16 tensor on cuda:0, got torch.float32 on cpu"):
        q.linear(torch.zeros(2, 256))
    with pytest.raises(ValueError, match=r"q4_0x8 is a CPU layout; on cuda:0 the weights keep llama.cpp's"):
        QuantizedWeight([(INTERLEAVED_LAYOUTS["q4_0"], torch.zeros(8, 144, dtype=torch.uint8, device="cuda"))], 256)
