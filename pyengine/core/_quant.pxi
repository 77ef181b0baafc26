# Cython bindings of the quantized-weight kernels (csrc/include/pyengine/cpu_quant.h). Included
# by _core.pyx. The torch-facing API (argument checks, tensors) is pyengine/quant/; these
# wrappers take raw addresses (tensor.data_ptr()) and sizes.

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "pyengine/cpu_quant.h" namespace "pyengine::kernels" nogil:
    cdef enum class QuantType(int32_t):
        pass
    const int32_t kQuantAmxMinRows
    cdef struct QuantFormat:
        const char* name
        int32_t block_elems
        int32_t block_bytes
    QuantFormat quant_format(QuantType type) except +
    QuantType interleaved_type(QuantType type)
    void interleave_rows(QuantType type, const void* src, void* dst, int64_t rows, int64_t K) except +
    void deinterleave_rows(QuantType interleaved, const void* src, void* dst, int64_t rows,
                           int64_t K) except +
    int64_t quant_row_bytes(QuantType type, int64_t K) except +
    void quantize_rows(QuantType type, const float* src, void* dst, int64_t rows, int64_t K,
                       int32_t num_threads) except +
    void dequantize_rows(QuantType type, const void* src, float* dst, int64_t rows,
                         int64_t K) except +
    void dequantize_gather(QuantType type, const void* src, int64_t num_rows, int64_t K,
                           const int64_t* ids, int64_t count, float* dst) except +
    void dequantize_gather_i32 "dequantize_gather"(
        QuantType type, const void* src, int64_t num_rows, int64_t K, const int32_t* ids, int64_t count,
        float* dst) except +
    void quantize_activation_blocks(const float* x, int64_t ldx, int32_t M, int32_t K, int32_t block,
                                    void* out) except +
    void linear_quant(float* y, int64_t ldy, const float* x, int64_t ldx, int32_t M,
                      const void* weight, QuantType type, int32_t N, int32_t K,
                      const float* bias, int32_t num_threads) except +


# rows of x from which linear_quant multiplies interleaved layouts with AMX (where _cpu_amx())
QUANT_AMX_MIN_ROWS = kQuantAmxMinRows

def _quant_format(int32_t type_id) -> tuple:
    """(name, block_elems, block_bytes) of a GGML type id. Raises ValueError for an unknown id."""
    cdef QuantFormat f = quant_format(<QuantType>type_id)
    return f.name.decode(), f.block_elems, f.block_bytes


def _interleaved_type(int32_t type_id) -> int:
    """The type id of the interleaved layout of `type_id` (8 rows side by side), or `type_id`
    itself where there is none."""
    return <int32_t>interleaved_type(<QuantType>type_id)


def _interleave_rows(int32_t type_id, uintptr_t src, uintptr_t dst, int64_t rows, int64_t K):
    with nogil:
        interleave_rows(<QuantType>type_id, <const void*>src, <void*>dst, rows, K)


def _deinterleave_rows(int32_t type_id, uintptr_t src, uintptr_t dst, int64_t rows, int64_t K):
    with nogil:
        deinterleave_rows(<QuantType>type_id, <const void*>src, <void*>dst, rows, K)


def _quant_row_bytes(int32_t type_id, int64_t K) -> int:
    return quant_row_bytes(<QuantType>type_id, K)


def _quantize_rows(int32_t type_id, uintptr_t src, uintptr_t dst, int64_t rows, int64_t K,
                   int32_t num_threads):
    with nogil:
        quantize_rows(<QuantType>type_id, <const float*>src, <void*>dst, rows, K, num_threads)


def _dequantize_rows(int32_t type_id, uintptr_t src, uintptr_t dst, int64_t rows, int64_t K):
    with nogil:
        dequantize_rows(<QuantType>type_id, <const void*>src, <float*>dst, rows, K)


def _dequantize_gather(int32_t type_id, uintptr_t src, int64_t num_rows, int64_t K, uintptr_t ids,
                       int64_t count, uintptr_t dst):
    with nogil:
        dequantize_gather(<QuantType>type_id, <const void*>src, num_rows, K, <const int64_t*>ids,
                          count, <float*>dst)


def _dequantize_gather_i32(int32_t type_id, uintptr_t src, int64_t num_rows, int64_t K, uintptr_t ids,
                           int64_t count, uintptr_t dst):
    with nogil:
        dequantize_gather_i32(<QuantType>type_id, <const void*>src, num_rows, K, <const int32_t*>ids,
                              count, <float*>dst)


def _quantize_activation_blocks(uintptr_t x, int64_t ldx, int32_t M, int32_t K, int32_t block, uintptr_t out):
    with nogil:
        quantize_activation_blocks(<const float*>x, ldx, M, K, block, <void*>out)


def _linear_quant(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, int32_t M, uintptr_t weight,
                  int32_t type_id, int32_t N, int32_t K, uintptr_t bias, int32_t num_threads):
    with nogil:
        linear_quant(<float*>y, ldy, <const float*>x, ldx, M, <const void*>weight,
                     <QuantType>type_id, N, K, <const float*>bias, num_threads)


# The GPU's weight-only quantized linear layer (csrc/include/pyengine/cuda_quant.h); device
# addresses, the activations' DType as an int, the CUDA device index of the addresses, the
# stream as an address. In a build without CUDA it raises RuntimeError.
cdef extern from "pyengine/cuda_quant.h" namespace "pyengine::kernels::cuda" nogil:
    void cuda_linear_quant "pyengine::kernels::cuda::linear_quant" (
        void* y, int64_t ldy, const void* x, int64_t ldx, DType dtype, int32_t M, const void* weight,
        QuantType type, int32_t N, int32_t K, const void* bias, int32_t device, void* stream) except +
    void cuda_dequantize_rows "pyengine::kernels::cuda::dequantize_rows" (
        void* out, int64_t ldo, DType dtype, const void* weight, QuantType type, int32_t N, int32_t K,
        const int64_t* ids, int64_t base, int32_t rows, int32_t device, void* stream) except +


def _cuda_linear_quant(uintptr_t y, int64_t ldy, uintptr_t x, int64_t ldx, int dtype, int32_t M,
                       uintptr_t weight, int32_t type_id, int32_t N, int32_t K, uintptr_t bias,
                       int32_t device, uintptr_t stream):
    with nogil:
        cuda_linear_quant(<void*>y, ldy, <const void*>x, ldx, <DType>dtype, M, <const void*>weight,
                          <QuantType>type_id, N, K, <const void*>bias, device, <void*>stream)


def _cuda_dequantize_rows(uintptr_t out, int64_t ldo, int dtype, uintptr_t weight, int32_t type_id, int32_t N,
                          int32_t K, uintptr_t ids, int64_t base, int32_t rows, int32_t device, uintptr_t stream):
    with nogil:
        cuda_dequantize_rows(<void*>out, ldo, <DType>dtype, <const void*>weight, <QuantType>type_id, N, K,
                             <const int64_t*>ids, base, rows, device, <void*>stream)
