"""The host's memory figures that the KV capacity estimate needs: memory the system can still
give, this process's resident set and its high-water mark.

Linux answers from /proc (exact, and the high-water mark can be reset). Elsewhere (macOS, BSDs,
containers without /proc) psutil answers when it is installed, else `os.sysconf` and
`resource.getrusage`: the high-water mark then cannot be reset, so a peak measured with it is the
process's all-time peak (an overestimate of a transient peak: the KV pool comes out smaller,
never too big).
"""

from __future__ import annotations

import os
import resource
import sys

PROC = "/proc"  # a module attribute so that tests can point it elsewhere


def _proc_fields(path: str, *fields: str) -> list[int] | None:
    """The `field: N kB` lines of a /proc file, in bytes; None when the file is absent."""
    found: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in fields:
                    found[name] = int(line.split()[1]) * 1024
    except OSError:
        return None
    missing = [x for x in fields if x not in found]
    if missing:
        raise OSError(f"{missing[0]} not in {path}")
    return [found[x] for x in fields]


def _psutil():
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def _max_rss_bytes() -> int:
    """getrusage's all-time high-water mark: kilobytes on Linux, bytes on macOS."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def available_bytes() -> int:
    """Memory the system can still give without swapping (MemAvailable on Linux)."""
    got = _proc_fields(f"{PROC}/meminfo", "MemAvailable")
    if got is not None:
        return got[0]
    psutil = _psutil()
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError) as e:
        raise OSError("cannot tell the available memory on this system (no /proc, no psutil, no "
                      "sysconf SC_AVPHYS_PAGES): install psutil, or size the KV cache with "
                      "KvCacheConfig(max_tokens=...)") from e


def rss_bytes() -> int:
    """This process's resident set now."""
    got = _proc_fields(f"{PROC}/self/status", "VmRSS")
    if got is not None:
        return got[0]
    psutil = _psutil()
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    return _max_rss_bytes()  # no current figure anywhere: the high-water mark bounds it


def reset_peak_rss() -> bool:
    """Resets the resident set's high-water mark to the current resident set; False where the
    system cannot (then peak_rss_bytes() is the process's all-time peak)."""
    try:
        with open(f"{PROC}/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The resident set's high-water mark (since the last reset_peak_rss() where it worked)."""
    got = _proc_fields(f"{PROC}/self/status", "VmHWM")
    if got is not None:
        return got[0]
    return _max_rss_bytes()
