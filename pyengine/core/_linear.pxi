# Cython bindings of the CPU bf16 linear kernel (csrc/include/pyengine/cpu_linear.h).
# Included by _core.pyx. The torch-facing API (argument checks) is pyengine/cpu_linear.py;
# these wrappers take raw addresses (tensor.data_ptr()) and sizes.

from libc.stdint cimport int32_t, uint16_t, uintptr_t

cdef extern from "pyengine/cpu_linear.h" namespace "pyengine::kernels" nogil:
    const int32_t kLinearBf16MaxRows
    void linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight,
                     const uint16_t* bias, int32_t M, int32_t N, int32_t K,
                     int32_t num_threads) except +
    const char* linear_bf16_isa()


LINEAR_BF16_MAX_ROWS = kLinearBf16MaxRows


def _linear_bf16(uintptr_t y, uintptr_t x, uintptr_t weight, uintptr_t bias, int32_t M,
                 int32_t N, int32_t K, int32_t num_threads):
    """Raw linear_bf16: addresses are tensor.data_ptr() values (bias 0: none). Raises ValueError
    (naming the argument) on invalid arguments."""
    with nogil:
        linear_bf16(<uint16_t*>y, <const uint16_t*>x, <const uint16_t*>weight,
                    <const uint16_t*>bias, M, N, K, num_threads)


def _linear_bf16_isa():
    """The code path _linear_bf16 takes on this machine: "avx512" or "generic"."""
    return linear_bf16_isa().decode()
