# Cython bindings of the CPU elementwise kernels (csrc/include/pyengine/cpu_elementwise.h).
# Included by _core.pyx. The torch-facing API is pyengine/cpu_elementwise.py; these wrappers
# take raw addresses (tensor.data_ptr()) and sizes.

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "pyengine/cpu_elementwise.h" namespace "pyengine::kernels" nogil:
    void rms_norm(void* out, int64_t out_stride, const void* x, int64_t x_stride, void* residual,
                  int64_t residual_stride, const void* weight, DType dtype, int32_t num_rows,
                  int32_t hidden, float eps, int32_t num_threads) except +
    void rotary_embedding(void* x, int64_t x_stride, int32_t num_tokens, int32_t num_heads,
                          int32_t head_dim, const void* cos, const void* sin, int32_t max_position,
                          const int32_t* positions, DType dtype, int32_t num_threads) except +
    void silu_mul(void* out, const void* gate_up, DType dtype, int32_t num_rows, int32_t inter,
                  int32_t num_threads) except +


def _rms_norm(uintptr_t out, int64_t out_stride, uintptr_t x, int64_t x_stride, uintptr_t residual,
              int64_t residual_stride, uintptr_t weight, int dtype, int32_t num_rows, int32_t hidden,
              float eps, int32_t num_threads):
    """Raw rms_norm (residual 0: none). Raises ValueError naming the bad argument."""
    with nogil:
        rms_norm(<void*>out, out_stride, <const void*>x, x_stride, <void*>residual, residual_stride,
                 <const void*>weight, <DType>dtype, num_rows, hidden, eps, num_threads)


def _rotary_embedding(uintptr_t x, int64_t x_stride, int32_t num_tokens, int32_t num_heads,
                      int32_t head_dim, uintptr_t cos, uintptr_t sin, int32_t max_position,
                      uintptr_t positions, int dtype, int32_t num_threads):
    """Raw rotary_embedding (in place). Raises ValueError naming the bad argument."""
    with nogil:
        rotary_embedding(<void*>x, x_stride, num_tokens, num_heads, head_dim, <const void*>cos,
                         <const void*>sin, max_position, <const int32_t*>positions, <DType>dtype,
                         num_threads)


def _silu_mul(uintptr_t out, uintptr_t gate_up, int dtype, int32_t num_rows, int32_t inter,
              int32_t num_threads):
    """Raw silu_mul. Raises ValueError naming the bad argument."""
    with nogil:
        silu_mul(<void*>out, <const void*>gate_up, <DType>dtype, num_rows, inter, num_threads)
