"""What the CPU can do natively, for choosing compute paths, and the instruction-set level
the CPU kernels run at (`cpu_info`, `set_cpu_isa`)."""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import pyengine.core._core as _core

#: Instruction-set levels of the CPU kernels, lowest first per architecture.
CPU_ISA_LEVELS: tuple[str, ...] = ("generic", "avx2", "avx512", "neon")

# CPU feature flags worth reporting with a figure (named as /proc/cpuinfo names them).
_REPORTED_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                   "avx512_vnni", "avx512_bf16", "amx_bf16", "asimd", "asimdhp", "bf16", "i8mm", "sve")

# bf16 weights on a CPU without native bf16 instructions: from this many rows an fp32 GEMM on
# the weights converted on the fly (torch) is used; below, pyengine's linear_bf16. Measured on an
# AVX2 EPYC (smollm-135m-shape's gate_up and down, 2 threads): linear_bf16 runs at 1.0-2.7x the
# converting GEMM's rate from 16 to 64 rows (93-117 vs 38-110 GFLOP/s). At the avx2 and avx512
# levels pyengine's GEMM takes over from GEMM_MIN_ROWS = 13 rows already (pyengine/layers/linear.py).
EMULATED_BF16_MIN_ROWS = 65
# bf16 weights on a CPU with bf16 instructions (AVX512-BF16/AMX): torch's bf16 GEMM costs about
# the same 40-120 us from 1 to 16 rows (smollm-135m-shape's layers, 2 threads), while linear_bf16
# streams the weights at memory speed. With AMX (measured on a Xeon): 2.0-2.5x faster at 1-2 rows,
# equal at 4, 0.6x at 8. With AVX512-BF16 and no AMX (an AMD EPYC; the layers' weights read from
# DRAM): 3.4x at 1 row, 1.5x at 4, 1.3x at 8, 0.7x at 12. Up to this many rows the kernel (and the
# one-call decode path):
NATIVE_BF16_KERNEL_MAX_ROWS_AMX = 4
NATIVE_BF16_KERNEL_MAX_ROWS = 8  # AVX512-BF16 without AMX
# fp32 weights: up to this many rows pyengine's linear_f32 (at 16 rows 1.1-1.3x torch's sgemm on
# the same machine; from 32 rows torch's sgemm is faster), and the one-call decode path; at the
# avx2 and avx512 levels pyengine's GEMM from GEMM_MIN_ROWS = 13 rows (pyengine/layers/linear.py).
FAST_FP32_MAX_ROWS = 16


def bf16_kernel_max_rows() -> int:
    """Rows up to which bf16 linears on the CPU use pyengine's linear_bf16: every batch below
    the fp32-GEMM threshold where bf16 matrix work is emulated, small decode batches where it is
    native (see native_bf16_matmul): fewer with AMX, whose GEMM is faster from fewer rows on."""
    if not native_bf16_matmul():
        return EMULATED_BF16_MIN_ROWS - 1
    return NATIVE_BF16_KERNEL_MAX_ROWS_AMX if "amx_bf16" in cpu_flags() else NATIVE_BF16_KERNEL_MAX_ROWS


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU features the kernels care about, named as /proc/cpuinfo names them, from the C++
    core's own detection (cpuid/xgetbv on x86-64, HWCAP on aarch64 Linux): no /proc needed."""
    return frozenset(_core._cpu_feature_flags())


def native_bf16_matmul() -> bool:
    """True where bf16 matrix work runs on hardware (AVX512-BF16 or AMX); the
    PYENGINE_BF16_MATMUL variable forces "native" or "fp32"."""
    forced = os.environ.get("PYENGINE_BF16_MATMUL", "auto")
    if forced in ("native", "fp32"):
        return forced == "native"
    flags = cpu_flags()
    return not flags or "avx512_bf16" in flags or "amx_bf16" in flags


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name: the C++ core's (the cpuid brand string on x86-64); where the CPU does
    not say (aarch64), /proc/cpuinfo's CPU part where there is one, else the machine type."""
    name = _core._cpu_model_name()
    if name:
        return name
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "CPU part")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown"


@dataclass(frozen=True)
class CpuInfo:
    """Which instruction-set level the CPU kernels run at, and why.

    isa: the active level ("generic", "avx2", "avx512" or "neon").
    reason: why it is active: "the highest level this CPU supports", "PYENGINE_CPU_ISA=avx2"
        or "set_cpu_isa()".
    supported: the levels this CPU supports, lowest first.
    model: the CPU's model name.
    flags: the instruction-set flags that matter for the kernels, as /proc/cpuinfo names them.
    native_bf16_matmul: whether bf16 matrix products run on hardware (AVX512-BF16 or AMX);
        without it pyengine's own bf16 kernels replace torch's emulated ones.
    vnni: the VNNI instructions the quantized kernels use ("avx_vnni" at avx2, "avx512_vnni" at
        avx512), or "" where they use none: the level has none, the CPU lacks it, or
        PYENGINE_CPU_VNNI=0 / set_cpu_vnni(False) turned it off. Results are the same bits either
        way; only the speed differs.
    amx: "amx_bf16" where the quantized kernels multiply batches of 16 rows or more with AMX (the
        weights dequantized to bf16 a tile at a time, the activations rounded to bf16: other
        results than the 8-bit path's, within the same error bounds), else "": the level is not
        avx512, the CPU or the OS lacks it, or PYENGINE_CPU_AMX=0 / set_cpu_amx(False) turned it
        off.
    """

    isa: str
    reason: str
    supported: tuple[str, ...]
    model: str
    flags: tuple[str, ...]
    native_bf16_matmul: bool
    vnni: str = ""
    amx: str = ""

    def __str__(self) -> str:
        return (f"{self.model}: CPU kernels at {self.isa} ({self.reason}; supported: "
                f"{', '.join(self.supported)}; quantized kernels with {self.vnni or 'no VNNI'}"
                f"{', ' + self.amx if self.amx else ''}; "
                f"flags: {' '.join(self.flags) or 'none'})")


def cpu_info() -> CpuInfo:
    """The CPU kernels' instruction-set level and why. Raises ValueError naming the value and the
    levels this CPU has when PYENGINE_CPU_ISA is unknown or unsupported here."""
    isa = _core._cpu_isa()  # raises for a bad PYENGINE_CPU_ISA
    flags = cpu_flags()
    return CpuInfo(isa=isa, reason=_core._cpu_isa_reason(), supported=tuple(_core._supported_cpu_isas()),
                   model=cpu_model(), flags=tuple(f for f in _REPORTED_FLAGS if f in flags),
                   native_bf16_matmul=native_bf16_matmul(),
                   vnni=_core._cpu_vnni_flag(isa) if _core._cpu_vnni() else "",
                   amx="amx_bf16" if _core._cpu_amx() else "")


def set_cpu_isa(level: str) -> None:
    """Runs every CPU kernel at `level` from now on, in the whole process (tests, measurements of
    a lower level on a bigger CPU). Raises ValueError for an unknown level or one this CPU lacks.
    Not meant to be called while another thread runs kernels."""
    if level not in CPU_ISA_LEVELS:
        raise ValueError(f"unknown CPU instruction-set level {level!r} (known: {', '.join(CPU_ISA_LEVELS)}; "
                         f"this CPU has {', '.join(_core._supported_cpu_isas())})")
    _core._set_cpu_isa(level)


def set_cpu_vnni(enabled: bool) -> bool:
    """Turns the quantized kernels' VNNI off (False) or back on where the active level and the
    CPU have it (True), in the whole process; returns the previous setting. The results are the
    same bits either way (for measuring, and for tests of both code paths)."""
    return bool(_core._set_cpu_vnni(bool(enabled)))


def set_cpu_amx(enabled: bool) -> bool:
    """Turns the quantized kernels' AMX path off (False) or back on where the CPU has it (True),
    in the whole process; returns the previous setting. Unlike VNNI this changes results (bf16
    activations for batches of 16 rows or more, instead of 8-bit blocks)."""
    return bool(_core._set_cpu_amx(bool(enabled)))
