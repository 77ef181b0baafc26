"""A CPU model's weights in one anonymous memory region, backed by 2 MiB huge pages where the
kernel grants them.

Why: batch-1 decode streams every weight once per token, and on the CPU how fast it streams
depends on the pages under it. Weights that are views of the safetensors file's mmap sit in
4 KiB page-cache pages; each 4 KiB page costs a TLB miss and a page walk, and the hardware
prefetcher stops at every page boundary. Measured on a 2-core Xeon (bench/README.md), the
output projection of a bf16 model (311 MB) streamed at 21.6 GB/s from the file mapping, 28.2
from a plain copy and 30.0 from a copy in huge pages.

A CPU model's KV pool lives in such a region too (WeightArena.zeros), faulted in at start-up:
decode attention streams every cached K/V row of the sequence each step, and from 4 KiB pages
it ran 11-14% slower.

So the weights phase copies the weights into one region: an anonymous private mapping whose
base is 2 MiB aligned, advised MADV_HUGEPAGE before it is touched (transparent huge pages in
"madvise" mode, the usual default, then back it with huge pages; in "always" mode they would
anyway, in "never" the copy still leaves the page cache behind). Each tensor starts on a 4 KiB
boundary. The tensors are moved one at a time, so the memory peak is the weights plus the
largest tensor, not twice the weights.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
TENSOR_ALIGN_BYTES = 4096


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class WeightArena:
    """The region the weights were copied into: `nbytes` reserved (the tensors with their
    alignment), whether MADV_HUGEPAGE was advised, and the mapping itself (`buffer`, a
    uint8 tensor over the aligned region; the tensors placed in it are views of it)."""

    nbytes: int
    huge_pages_advised: bool
    buffer: torch.Tensor
    used: int = 0

    @classmethod
    def reserve(cls, nbytes: int) -> "WeightArena":
        """Maps `nbytes` (rounded up to whole huge pages) of anonymous memory, 2 MiB aligned,
        nothing touched yet."""
        size = _round_up(max(nbytes, 1), HUGE_PAGE_BYTES)
        # MAP_PRIVATE: Python's default for an anonymous mmap is MAP_SHARED, which is shmem, and
        # shmem takes huge pages only where the system's shmem_enabled allows (rarely)
        region = mmap.mmap(-1, size + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
        start = -whole.data_ptr() % HUGE_PAGE_BYTES
        advised = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                region.madvise(mmap.MADV_HUGEPAGE, start, size)
                advised = True
            except OSError as e:  # a kernel built without transparent huge pages
                logger.info("pyengine: weights in 4 KiB pages: madvise(MADV_HUGEPAGE) failed: %s", e)
        return cls(nbytes=size, huge_pages_advised=advised, buffer=whole[start:start + size])

    @staticmethod
    def footprint(t: torch.Tensor) -> int:
        """The bytes a tensor takes in an arena, with its alignment."""
        return _round_up(t.nbytes, TENSOR_ALIGN_BYTES)

    def copy_in(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` (a contiguous CPU tensor) at the next free aligned offset."""
        if t.device.type != "cpu":
            raise ValueError(f"weight arena: a CPU tensor is needed, got one on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"weight arena: a contiguous tensor is needed, got shape {tuple(t.shape)} with "
                             f"strides {t.stride()}")
        size = self.footprint(t)
        if self.used + size > self.nbytes:
            raise ValueError(f"weight arena: {t.nbytes} bytes do not fit ({self.nbytes - self.used} of "
                             f"{self.nbytes} left)")
        view = self.buffer[self.used:self.used + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        self.used += size
        return view

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of zeros at the next free aligned offset, untouched until written (the
        region is fresh anonymous memory, which reads as zeros)."""
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = _round_up(nbytes, TENSOR_ALIGN_BYTES)
        if self.used + size > self.nbytes:
            raise ValueError(f"weight arena: {nbytes} bytes do not fit ({self.nbytes - self.used} of "
                             f"{self.nbytes} left)")
        view = self.buffer[self.used:self.used + nbytes].view(dtype).view(shape)
        self.used += size
        return view

    def huge_page_bytes(self) -> int:
        """The bytes of the region the kernel backs with huge pages now (AnonHugePages of its
        mappings in /proc/self/smaps; 0 where that file does not exist)."""
        lo = self.buffer.data_ptr()
        hi = lo + self.nbytes
        total = 0
        inside = False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
                        start, end = (int(x, 16) for x in head.split("-"))
                        inside = start < hi and end > lo
                    elif inside and head == "AnonHugePages:":
                        total += int(line.split()[1]) * 1024
        except OSError:
            return 0
        return total

    def as_dict(self) -> dict[str, int | bool]:
        return {"bytes": self.used, "huge_pages_advised": self.huge_pages_advised,
                "huge_page_bytes": self.huge_page_bytes()}
