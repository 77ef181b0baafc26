"""Where the engine runs: parsing the `device` argument and checking that it can be used."""

from __future__ import annotations

import torch

from pyengine.core import cuda_kernels_built

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def resolve_device(device: str | torch.device) -> torch.device:
    """"cpu", "cuda" or "cuda:N" (or a torch.device) -> torch.device, checked: a CUDA device
    needs a GPU that torch sees and a build with the CUDA kernels. Raises ValueError naming
    the device otherwise."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = torch.version.cuda and f"CUDA {torch.version.cuda}" or "no CUDA (a CPU-only build)"
        raise ValueError(f"device={device!r}: torch sees no CUDA device (torch {torch.__version__}, {build})")
    if not cuda_kernels_built():
        raise ValueError(f"device={device!r}: this pyengine was built without its CUDA kernels "
                         "(no nvcc or no CUTLASS headers at install time); reinstall with both")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(f"device={device!r}: no such CUDA device ({torch.cuda.device_count()} visible)")
    return torch.device("cuda", index)
