// CPU GEMM for prefill and large decode batches: y = x . W^T (+ bias) with any number of rows
// of x, in fp32 (or bf16 values multiplied in fp32).
//
// Layouts (row-major, contiguous): x [M, K], weight [N, K] (the PyTorch nn.Linear layout),
// bias [N] or null, y [M, N]; all of one dtype (bf16 as raw uint16_t bit patterns).
// Errors: invalid arguments throw std::invalid_argument naming the argument.
//
// Where pyengine/cpu_linear.h's kernels read each weight row once for a few rows of x, these
// are compute-bound: x is packed once per call into panels of consecutive rows (transposed, so
// that a vector holds one column of several rows), each weight element is broadcast against a
// panel, and the weights themselves are read in place, never copied (bf16 rows are widened to
// fp32 a few rows at a time). In parallel over output columns (`num_threads` <= 0: OpenMP's
// default), with the compute code of the active instruction-set level (pyengine/cpu_isa.h).
//
// Every output is one fp32 sum over k = 0 .. K-1 in order (one fused multiply-add per term
// where the level has FMA), then + bias: a row's result does not depend on M, on the rows
// batched with it, or on the thread count. The order differs from a BLAS GEMM's blocked sums, so
// results differ from torch's in the last bits.
#pragma once

#include <cstdint>

namespace pyengine::kernels {

// y[m, n] = sum_k x[m, k] * weight[n, k] + bias[n] in fp32; M >= 1.
void gemm_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M,
              int32_t N, int32_t K, int32_t num_threads);

// The same on bf16 values: exact bf16 products, fp32 accumulation, the result (+ bias) rounded
// to bf16 (nearest even), as torch's fp32 GEMM on the values converted to fp32 would be.
void gemm_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
               int32_t M, int32_t N, int32_t K, int32_t num_threads);

// Where linear layers of fp32 (and of bf16 on CPUs without bf16 instructions) run as this GEMM
// rather than as pyengine/cpu_linear.h's decode kernels: from kGemmMinRows rows of x, at the
// levels whose GEMM build is tuned (avx2, avx512; the generic and NEON builds are correct, not
// fast). The one-call decode path (cpu_decode.h) and the Python model's linears both follow it.
// Measured on an Intel Xeon at both levels (smollm-135m-shape's layers, weights from DRAM, 2
// threads): the GEMM reaches the decode kernels' rate at 12-13 rows and is 1.1-1.5x faster from
// 14 (1.2-1.5x from 24 to 64 rows), while at 1-8 rows the decode kernels are up to 1.5x faster.
constexpr int32_t kGemmMinRows = 13;
bool gemm_routed();                 // the active level is one of those
bool gemm_preferred(int32_t rows);  // rows >= kGemmMinRows && gemm_routed()

}  // namespace pyengine::kernels
