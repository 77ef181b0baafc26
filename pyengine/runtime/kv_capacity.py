"""KV capacity: measured at start-up, not guessed (TensorRT-LLM's two-pass build).

Pass 1 builds the executor with a small cache, runs a worst-case dummy batch
(`max_num_tokens` of context plus a full decode batch) and reads the memory it peaked at;
the memory still available with that peak taken out, times `free_memory_fraction`, capped
by `max_tokens` and `max_memory_bytes`, is the pool's budget:

    blocks = floor(B_free / (n_layers * 2 * n_kv_heads * head_dim * bytes_per_elem * tokens_per_block))

Pass 1's cache is torn down before pass 2 builds the real one. On the CPU the peak is the
process's resident set high-water mark (VmHWM, reset before the dummy batch) and the
available memory is the system's MemAvailable. On a GPU they are torch's allocator figures
(peak allocated, reset before the dummy batch) and the device's free memory
(`torch.cuda.mem_get_info`, after the allocator's cache is emptied).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from pyengine.runtime import host_memory

if TYPE_CHECKING:
    import torch

SKIP_ENV = "PYENGINE_SKIP_KV_ESTIMATION"


@dataclass
class KvCapacity:
    num_blocks: int
    tokens_per_block: int
    bytes_per_block: int
    source: str                          # "estimated" or "configured"
    available_bytes: int | None = None   # memory available, the dummy batch's transient peak taken out
    peak_bytes: int | None = None        # the dummy batch's peak above what stayed resident
    rss_before: int | None = None        # resident set before / at the peak of / after the dummy batch
    rss_peak: int | None = None
    rss_after: int | None = None
    free_memory_fraction: float | None = None
    budget_bytes: int | None = None      # B_free after the caps
    max_tokens: int | None = None        # caps in force
    max_memory_bytes: int | None = None
    seq_slot_cap_blocks: int | None = None   # never more than every sequence slot at max_seq_len needs

    @property
    def max_tokens_in_pool(self) -> int:
        return self.num_blocks * self.tokens_per_block

    def as_dict(self) -> dict:
        return asdict(self) | {"pool_bytes": self.num_blocks * self.bytes_per_block}


@dataclass
class MemoryReading:
    available_bytes: int   # what the system could still give, the transient peak taken out
    peak_bytes: int        # the dummy batch's transient peak: high-water mark minus what stayed resident
    rss_before: int = 0    # resident set before the dummy batch
    rss_peak: int = 0      # its high-water mark during it
    rss_after: int = 0


class CpuMemoryProbe:
    """Measures the transient peak of a function on the CPU."""

    def measure(self, run: Callable[[], None]) -> MemoryReading:
        host_memory.reset_peak_rss()  # where it cannot, the peak below is the all-time one (larger)
        before = host_memory.rss_bytes()
        run()
        after, hwm = host_memory.rss_bytes(), host_memory.peak_rss_bytes()
        peak = max(0, hwm - after)  # what the batch needed beyond what stays resident
        return MemoryReading(available_bytes=max(0, host_memory.available_bytes() - peak), peak_bytes=peak,
                             rss_before=before, rss_peak=hwm, rss_after=after)


class CudaMemoryProbe:
    """Measures the transient peak of a function on a GPU, from torch's allocator."""

    def __init__(self, device: "torch.device") -> None:
        self.device = device

    def measure(self, run: Callable[[], None]) -> MemoryReading:
        import torch
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        run()
        torch.cuda.synchronize(dev)
        after, hwm = torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
        peak = max(0, hwm - after)
        torch.cuda.empty_cache()  # what the allocator cached is free memory for the pool
        free, _total = torch.cuda.mem_get_info(dev)
        return MemoryReading(available_bytes=max(0, free - peak), peak_bytes=peak, rss_before=before,
                             rss_peak=hwm, rss_after=after)


def skip_requested() -> bool:
    return os.environ.get(SKIP_ENV, "") not in ("", "0")


def configured_capacity(max_tokens: int, tokens_per_block: int, bytes_per_block: int) -> KvCapacity:
    return KvCapacity(num_blocks=math.ceil(max_tokens / tokens_per_block), tokens_per_block=tokens_per_block,
                      bytes_per_block=bytes_per_block, source="configured", max_tokens=max_tokens)


def capacity_from_reading(reading: MemoryReading, *, tokens_per_block: int, bytes_per_block: int,
                          free_memory_fraction: float, max_tokens: int | None, max_memory_bytes: int | None,
                          seq_slot_cap_blocks: int) -> KvCapacity:
    """The formula, from measured figures."""
    budget = int(reading.available_bytes * free_memory_fraction)
    if max_memory_bytes is not None:
        budget = min(budget, max_memory_bytes)
    if max_tokens is not None:
        budget = min(budget, math.ceil(max_tokens / tokens_per_block) * bytes_per_block)
    blocks = min(budget // bytes_per_block, seq_slot_cap_blocks)
    return KvCapacity(num_blocks=blocks, tokens_per_block=tokens_per_block, bytes_per_block=bytes_per_block,
                      source="estimated", available_bytes=reading.available_bytes, peak_bytes=reading.peak_bytes,
                      rss_before=reading.rss_before, rss_peak=reading.rss_peak, rss_after=reading.rss_after,
                      free_memory_fraction=free_memory_fraction, budget_bytes=budget, max_tokens=max_tokens,
                      max_memory_bytes=max_memory_bytes, seq_slot_cap_blocks=seq_slot_cap_blocks)
