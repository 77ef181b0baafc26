"""Giving freed heap memory back to the operating system."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_libc = None


def release_free_heap() -> bool:
    """Asks glibc to return the free pages of its heaps (malloc_trim(0)). A load that converts
    tensors one at a time (quantize-on-load, repacking) frees gigabytes of float copies that glibc
    would otherwise keep mapped, counted in the process's resident memory. Returns whether
    anything could be asked (False without glibc)."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is None:
        return False
    trim(0)
    return True
