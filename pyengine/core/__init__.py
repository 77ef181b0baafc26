"""The C++ core through its Cython bindings (``_core.pyx`` and the ``.pxi`` files beside it).

``CoreBatchManager`` is the batch manager (scheduling, sequence slots, the KV cache manager,
the forward's metadata buffers); the underscored functions of ``_core`` take raw addresses
and are wrapped, with their checks, by ``pyengine.layers``. Nothing here imports torch.
"""

from pyengine.core._core import (CAPACITY_POLICIES, QUEUE_POLICIES, CapacitySchedulerPolicy, CoreBatchManager,
                                 FinishReason, QueuePolicy, _cuda_architectures, _cuda_kernels_built)

__all__ = ["CoreBatchManager", "CapacitySchedulerPolicy", "FinishReason", "QueuePolicy", "CAPACITY_POLICIES",
           "QUEUE_POLICIES", "cuda_kernels_built", "cuda_architectures"]


def cuda_kernels_built() -> bool:
    """True when this build has the CUDA kernels (nvcc and the CUTLASS headers were found)."""
    return _cuda_kernels_built()


def cuda_architectures() -> str:
    """The CUDA architectures the kernels were compiled for, e.g. ``"80;90a"`` ("" without them)."""
    return _cuda_architectures()
