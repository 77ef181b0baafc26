// Weight-only quantized linear layer on the GPU: the block formats of pyengine/cpu_quant.h
// (llama.cpp's Q8_0, Q5_0, Q5_1, Q4_0, Q4_K, Q5_K, Q6_K, and pyengine's Q4_Z for AWQ/GPTQ checkpoints),
// read in their llama.cpp row layout from device memory and dequantized on the fly; the
// activations stay in their floating-point type and the sums are fp32.
//
// Every pointer is a *device* pointer of CUDA device `device`; the launch goes on `stream` (a
// cudaStream_t of that device, passed as void*), with that device made current for the call;
// nothing synchronizes or allocates, so a call can be captured in a CUDA graph. It needs a GPU
// of compute capability 8.0 or newer (std::runtime_error naming the device otherwise).
// Errors: invalid arguments throw std::invalid_argument naming the argument; a failed launch
// throws std::runtime_error with CUDA's message. In a build without CUDA it throws
// std::runtime_error saying so.
#pragma once

#include <cstdint>

#include "pyengine/cpu_quant.h"
#include "pyengine/kernels.h"

namespace pyengine::kernels::cuda {

// y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]) for W [N, K] quantized as `type` (a plain
// layout: N rows of quant_row_bytes(type, K) bytes), x [M, K] and y [M, N] (rows ldx / ldy
// elements apart) and bias [N] in `dtype` (float32, bfloat16 or float16). One warp per weight
// row, its lanes dequantizing 4 consecutive weights each (a warp covers 128 weights of the row
// at a time) into registers and multiplying them with up to 8 rows of x per pass: reads the
// weights once per 8 rows of x. A GEMV for the smallest M; beyond, dequantize_rows into a
// scratch matrix and a tensor-core GEMM are faster (QuantizedWeight.linear chooses).
void linear_quant(void* y, int64_t ldy, const void* x, int64_t ldx, DType dtype, int32_t M, const void* weight,
                  QuantType type, int32_t N, int32_t K, const void* bias, int32_t device, void* stream);

// out[r, 0:K] (rows ldo elements apart, in `dtype`) = the dequantized weight row ids[r] - base
// (ids: `rows` int64 device values), or without ids row base + r, for r < rows; an output row
// whose source row is outside [0, N) is left unwritten (an embedding lookup validates its ids
// before; a table split in row groups of several formats calls once per group with base = the
// group's first row). The values are those of the CPU's dequantize_rows, rounded to `dtype`.
void dequantize_rows(void* out, int64_t ldo, DType dtype, const void* weight, QuantType type, int32_t N, int32_t K,
                     const int64_t* ids, int64_t base, int32_t rows, int32_t device, void* stream);

}  // namespace pyengine::kernels::cuda
