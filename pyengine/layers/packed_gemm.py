"""bf16 weights pre-packed for torch's oneDNN GEMM on the CPU.

torch's bf16 `F.linear` on the CPU runs oneDNN, which reorders the weight into its blocked
layout on every call; for the GEMMs of decode batches (tens of rows against weights of a
few MB) that reorder costs as much as the multiplication. `pack` does it once at load:
oneDNN's packed weight (an opaque tensor beside the plain one, as many bytes) multiplied by
`packed_linear` gives F.linear's result (the same kernel family and accumulation: equal on
the CPUs measured) in 0.5-0.8x the time from 1 to 256 rows (smollm-135m-shape's linears,
AMX Xeon, 2 threads). The plain weight stays: pyengine's own kernels (`linear_bf16`, the
one-call decode layers) read it for the smallest batches. The engine packs where the copies
fit in a quarter of the available memory, unless told otherwise (EngineConfig.pack_bf16_weights).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("pyengine")

# The batch size oneDNN is told to expect when it chooses the packed layout (any row count
# works with it): the decode batches the packed path is for.
_PACK_HINT_ROWS = 64


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a 2-D bf16 CPU weight [N, K], or None where this torch build or
    CPU cannot pack it (the caller keeps F.linear)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
    except (RuntimeError, AttributeError) as e:  # (no oneDNN, or no bf16 support in it)
        logger.info("pyengine: bf16 weights not packed for oneDNN (%s)", e)
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for the 2-D bf16 `x`, with `packed` = pack(weight)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def packing_works() -> bool:
    """Whether packed_linear gives F.linear's result here (checked once, on a small weight):
    where it does not, no weight is packed."""
    global _works
    if _works is None:
        g = torch.Generator().manual_seed(0)
        w = (torch.randn(48, 64, generator=g) * 0.1).bfloat16()
        x = torch.randn(5, 64, generator=g).bfloat16()
        p = pack(w)
        _works = p is not None and torch.allclose(packed_linear(x, p).float(), torch.nn.functional.linear(x, w).float(),
                                                  rtol=1e-2, atol=1e-2)
    return _works


_works: bool | None = None
