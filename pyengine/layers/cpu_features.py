"""What the CPU can do natively, for choosing compute paths."""

from __future__ import annotations

import functools
import os

# Rows at which converting bf16 weights to fp32 on the fly beats torch's bf16 GEMM on a CPU
# without native bf16 instructions (measured: 1.5x at 64 rows, 5x at 2,048; slower at 1).
EMULATED_BF16_MIN_ROWS = 16


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16_matmul() -> bool:
    """True where bf16 matrix work runs on hardware (AVX512-BF16 or AMX); the
    PYENGINE_BF16_MATMUL variable forces "native" or "fp32"."""
    forced = os.environ.get("PYENGINE_BF16_MATMUL", "auto")
    if forced in ("native", "fp32"):
        return forced == "native"
    flags = cpu_flags()
    return not flags or "avx512_bf16" in flags or "amx_bf16" in flags
