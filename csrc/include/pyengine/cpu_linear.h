// CPU linear layers for decode: y = x . W^T (+ bias) with few rows of x, in bf16 or fp32.
//
// Layouts (row-major, contiguous): x [M, K], weight [N, K] (the PyTorch nn.Linear layout),
// bias [N] or null, y [M, N]; all of one dtype (bf16 as raw uint16_t bit patterns).
// Errors: invalid arguments throw std::invalid_argument naming the argument.
//
// At batch 1 a linear layer is a GEMV, bound by how fast the weights stream from memory: both
// kernels read each weight row once for all rows of x, in parallel over output columns
// (`num_threads` <= 0: OpenMP's default), with the compute code of the active instruction-set
// level (pyengine/cpu_isa.h).
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// Rows of x that one call takes (1 <= M <= kLinearMaxRows: decode batches). Each weight tile is
// read from memory once and reused from cache for all rows, so up to here the kernels keep up
// with a BLAS GEMM that first converts bf16 weights to fp32.
constexpr int32_t kLinearMaxRows = 64;
constexpr int32_t kLinearBf16MaxRows = kLinearMaxRows;

// y[m, n] = bf16(sum_k x[m, k] * weight[n, k] + bias[n]): exact bf16 products, fp32
// accumulation, the result rounded to nearest even, as a bf16 GEMM does.
void linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
                 int32_t M, int32_t N, int32_t K, int32_t num_threads);

// y[m, n] = sum_k x[m, k] * weight[n, k] + bias[n] in fp32. The additions run in another order
// than a BLAS GEMM's (several partial sums per dot product), so results differ from torch's in
// the last bits.
void linear_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M,
                int32_t N, int32_t K, int32_t num_threads);

}  // namespace pyengine::kernels
