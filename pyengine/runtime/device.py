"""Where the engine runs: parsing the `device` argument and checking that it can be used."""

from __future__ import annotations

import torch

from pyengine.core import cuda_kernels_built

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
#: The oldest GPUs the CUDA kernels run on (cp.async and the SM80 tensor-core MMA: Ampere).
MIN_COMPUTE_CAPABILITY = (8, 0)


def check_compute_capability(device: str | torch.device, index: int, name: str, capability: tuple[int, int]) -> None:
    """Raises ValueError, naming the device, its GPU and compute capability, when that GPU is too
    old for the CUDA kernels; `device` is what the user asked for."""
    if tuple(capability) >= MIN_COMPUTE_CAPABILITY:
        return
    need = ".".join(map(str, MIN_COMPUTE_CAPABILITY))
    raise ValueError(f"device={device!r}: CUDA device {index} ({name}) has compute capability "
                     f"{capability[0]}.{capability[1]}; pyengine's CUDA kernels need {need} or newer "
                     "(cp.async, SM80 tensor-core MMA: Ampere or later); use another GPU or device='cpu'")


def resolve_device(device: str | torch.device) -> torch.device:
    """"cpu", "cuda" or "cuda:N" (or a torch.device) -> torch.device, checked: a CUDA device
    needs a GPU that torch sees, of compute capability 8.0 or newer, and a build with the CUDA
    kernels. Raises ValueError naming the device otherwise."""
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
    check_compute_capability(device, index, torch.cuda.get_device_name(index),
                             torch.cuda.get_device_capability(index))
    return torch.device("cuda", index)
