# Cython bindings of the CPU linear kernels (csrc/include/pyengine/cpu_linear.h), the CPU GEMM
# (csrc/include/pyengine/cpu_gemm.h) and of the
# run-time instruction-set level of every CPU kernel (csrc/include/pyengine/cpu_isa.h).
# Included by _core.pyx. The torch-facing API (argument checks) is pyengine/layers/linear.py;
# these wrappers take raw addresses (tensor.data_ptr()) and sizes.

from libc.stdint cimport int32_t, uint16_t, uintptr_t
from libcpp.string cimport string
from libcpp.vector cimport vector

cdef extern from "pyengine/cpu_linear.h" namespace "pyengine::kernels" nogil:
    const int32_t kLinearMaxRows
    void linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight,
                     const uint16_t* bias, int32_t M, int32_t N, int32_t K,
                     int32_t num_threads) except +
    void linear_f32(float* y, const float* x, const float* weight, const float* bias,
                    int32_t M, int32_t N, int32_t K, int32_t num_threads) except +

cdef extern from "pyengine/cpu_gemm.h" namespace "pyengine::kernels" nogil:
    void gemm_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight,
                   const uint16_t* bias, int32_t M, int32_t N, int32_t K,
                   int32_t num_threads) except +
    void gemm_f32(float* y, const float* x, const float* weight, const float* bias,
                  int32_t M, int32_t N, int32_t K, int32_t num_threads) except +
    const int32_t kGemmMinRows
    bint gemm_routed() except +
    bint gemm_preferred(int32_t rows) except +

cdef extern from "pyengine/cpu_isa.h" namespace "pyengine":
    cdef enum class CpuIsa(int32_t):
        pass
    const char* cpu_isa_name(CpuIsa isa)
    CpuIsa parse_cpu_isa(const string& name) except +
    vector[CpuIsa] supported_cpu_isas()
    CpuIsa cpu_isa() except +
    string cpu_isa_reason()
    void set_cpu_isa(CpuIsa isa) except +
    const char* cpu_vnni_flag(CpuIsa isa)
    bint cpu_vnni() except +
    bint set_cpu_vnni(bint enabled)
    bint cpu_amx() except +
    bint set_cpu_amx(bint enabled)
    # (const references in C++: declared by value, so Cython copies them)
    vector[string] cpu_feature_flags()
    string cpu_model_name()


LINEAR_MAX_ROWS = kLinearMaxRows
GEMM_MIN_ROWS = kGemmMinRows


def _gemm_routed():
    """Whether the active level's GEMM is the one linear layers route to (cpu_gemm.h's
    gemm_routed: avx2, avx512)."""
    return gemm_routed()


def _gemm_preferred(int32_t rows):
    """Whether a linear of `rows` rows runs as the GEMM (cpu_gemm.h's gemm_preferred: rows >=
    GEMM_MIN_ROWS at a routed level), as the one-call decode path decides it."""
    return gemm_preferred(rows)


def _linear_bf16(uintptr_t y, uintptr_t x, uintptr_t weight, uintptr_t bias, int32_t M,
                 int32_t N, int32_t K, int32_t num_threads):
    """Raw linear_bf16: addresses are tensor.data_ptr() values (bias 0: none). Raises ValueError
    (naming the argument) on invalid arguments."""
    with nogil:
        linear_bf16(<uint16_t*>y, <const uint16_t*>x, <const uint16_t*>weight,
                    <const uint16_t*>bias, M, N, K, num_threads)


def _linear_f32(uintptr_t y, uintptr_t x, uintptr_t weight, uintptr_t bias, int32_t M,
                int32_t N, int32_t K, int32_t num_threads):
    """Raw linear_f32, as _linear_bf16."""
    with nogil:
        linear_f32(<float*>y, <const float*>x, <const float*>weight, <const float*>bias,
                   M, N, K, num_threads)


def _gemm_bf16(uintptr_t y, uintptr_t x, uintptr_t weight, uintptr_t bias, int32_t M,
               int32_t N, int32_t K, int32_t num_threads):
    """Raw gemm_bf16, as _linear_bf16 (any M >= 1)."""
    with nogil:
        gemm_bf16(<uint16_t*>y, <const uint16_t*>x, <const uint16_t*>weight,
                  <const uint16_t*>bias, M, N, K, num_threads)


def _gemm_f32(uintptr_t y, uintptr_t x, uintptr_t weight, uintptr_t bias, int32_t M,
              int32_t N, int32_t K, int32_t num_threads):
    """Raw gemm_f32, as _linear_bf16 (any M >= 1)."""
    with nogil:
        gemm_f32(<float*>y, <const float*>x, <const float*>weight, <const float*>bias,
                 M, N, K, num_threads)


def _cpu_isa() -> str:
    """The instruction-set level the CPU kernels run at ("generic", "avx2", "avx512", "neon").
    Raises ValueError when PYENGINE_CPU_ISA names an unknown level or one the CPU lacks."""
    return cpu_isa_name(cpu_isa()).decode()


def _cpu_isa_reason() -> str:
    """Why _cpu_isa() is what it is (or the PYENGINE_CPU_ISA error)."""
    return cpu_isa_reason().decode()


def _supported_cpu_isas() -> list:
    """The levels this CPU supports, lowest first."""
    return [cpu_isa_name(l).decode() for l in supported_cpu_isas()]


def _cpu_feature_flags() -> list:
    """The CPU features that matter to the kernels, named as /proc/cpuinfo names them (x86-64:
    from cpuid/xgetbv; aarch64 Linux: from the kernel's HWCAP words)."""
    return [f.decode() for f in cpu_feature_flags()]


def _cpu_model_name() -> str:
    """The CPU's model name as /proc/cpuinfo shows it (x86-64: the cpuid brand string); "" where
    the CPU does not say (aarch64)."""
    return cpu_model_name().decode()


def _cpu_vnni() -> bool:
    """Whether the quantized kernels use VNNI now (the active level has it, the CPU has it, and
    neither PYENGINE_CPU_VNNI=0 nor _set_cpu_vnni(False) turned it off)."""
    return cpu_vnni()


def _cpu_vnni_flag(str name) -> str:
    """The feature flag of level `name`'s VNNI ("avx_vnni", "avx512_vnni"), or ""."""
    return cpu_vnni_flag(parse_cpu_isa(name.encode())).decode()


def _set_cpu_vnni(bint enabled) -> bool:
    """Turns VNNI off, or back on where the level and the CPU have it; returns the previous
    setting."""
    return set_cpu_vnni(enabled)


def _cpu_amx() -> bool:
    """Whether the quantized kernels use AMX-BF16 for batches of x now (level avx512, the CPU
    has it, Linux granted the tile state, and neither PYENGINE_CPU_AMX=0 nor _set_cpu_amx(False)
    turned it off)."""
    return cpu_amx()


def _set_cpu_amx(bint enabled) -> bool:
    """Turns AMX off, or back on where the CPU has it; returns the previous setting."""
    return set_cpu_amx(enabled)


def _set_cpu_isa(str name):
    """Runs the CPU kernels at level `name` from now on. Raises ValueError for an unknown level
    or one this CPU lacks."""
    set_cpu_isa(parse_cpu_isa(name.encode()))
