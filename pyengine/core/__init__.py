"""The C++ core through its Cython bindings (``_core.pyx`` and the ``.pxi`` files beside it).

``CoreBatchManager`` is the batch manager (scheduling, sequence slots, the KV cache manager,
the forward's metadata buffers); the underscored functions of ``_core`` take raw addresses
and are wrapped, with their checks, by ``pyengine.layers``. Nothing here imports torch.
"""

from pyengine.core._core import (CapacitySchedulerPolicy, CoreBatchManager, FinishReason, QueuePolicy)

__all__ = ["CoreBatchManager", "CapacitySchedulerPolicy", "FinishReason", "QueuePolicy"]
