// CPU linear layer for bf16 decode: y = x . W^T (+ bias) with few rows of x.
//
// Layouts (row-major, contiguous): x [M, K], weight [N, K] (the PyTorch nn.Linear layout),
// bias [N] or null, y [M, N]; all bf16 (raw uint16_t bit patterns).
// Errors: invalid arguments throw std::invalid_argument naming the argument.
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// Rows of x that linear_bf16 takes in one call (it reads each weight row once for all of them).
constexpr int32_t kLinearBf16MaxRows = 15;

// y[m, n] = bf16(sum_k x[m, k] * weight[n, k] + bias[n]): exact bf16 products, fp32
// accumulation, the result rounded to nearest even, as a bf16 GEMM does. For 1 <= M <=
// kLinearBf16MaxRows (batch-1 / small-batch decode, memory-bound: it streams the weight once).
// Parallel over output columns; `num_threads` <= 0 uses OpenMP's default.
// Uses AVX-512 where the CPU has it (not PYENGINE_DISABLE_AVX512=1), portable code otherwise.
void linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
                 int32_t M, int32_t N, int32_t K, int32_t num_threads);

// The code path linear_bf16 takes on this machine: "avx512" or "generic".
const char* linear_bf16_isa();

}  // namespace pyengine::kernels
