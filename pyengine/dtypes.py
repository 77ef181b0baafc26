"""The one table of dtypes: the names users write, the torch dtypes, and the C++ kernels'
``DType`` codes (read from the C++ enum through the bindings)."""

from __future__ import annotations

import torch

from pyengine.core._core import DType

#: Model (weights and activations) dtypes by name.
MODEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}
#: KV cache storage dtypes by name ("auto" follows the model's dtype); fp8 is CUDA-only.
KV_CACHE_DTYPES: dict[str, torch.dtype] = MODEL_DTYPES | {"float8_e4m3": torch.float8_e4m3fn}

#: torch dtype -> C++ DType of the activation dtypes (what every kernel takes).
ACTIVATION_CODES: dict[torch.dtype, int] = {torch.float32: int(DType.kFloat32),
                                            torch.bfloat16: int(DType.kBFloat16),
                                            torch.float16: int(DType.kFloat16)}
#: torch dtype -> C++ DType of the KV cache dtypes (activation dtypes plus fp8 e4m3, CUDA only).
CACHE_CODES: dict[torch.dtype, int] = ACTIVATION_CODES | {torch.float8_e4m3fn: int(DType.kFloat8E4M3)}


def model_dtype(dtype: str | torch.dtype, what: str = "dtype") -> torch.dtype:
    """A model dtype from its name or a torch dtype; ValueError naming the value otherwise."""
    if isinstance(dtype, torch.dtype) and dtype in MODEL_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in MODEL_DTYPES:
        return MODEL_DTYPES[dtype]
    raise ValueError(f"{what} must be one of {sorted(MODEL_DTYPES)}, got {dtype!r}")
