// The quantized linear kernel's AMX path (linear_quant_amx.cpp), for many rows of x on CPUs with
// AMX-BF16: each thread dequantizes a tile of 32 weight rows into bf16 in cache, in the tile
// layout AMX multiplies (no full-size copy of the weights is ever made), and multiplies it with x
// rounded to bf16, the sums in fp32. Used by linear_quant (pyengine/cpu_quant.h) from
// kQuantAmxMinRows rows of x on, for the interleaved layouts (below that, the 8-bit kernels cost
// less than dequantizing the bf16 tiles).
#pragma once

#include <cstdint>

#include "pyengine/cpu_quant.h"

namespace pyengine::kernels::cpu {

// True for the weight types the AMX path multiplies (the interleaved layouts).
bool amx_supports(QuantType type);

// y[M, N] (rows ldy apart) = x[M, K] (fp32, rows ldx apart) @ W.T (+ bias), W an interleaved
// layout of N rows (a multiple of 8) of wrow_bytes bytes, on `num_threads` threads. Only where
// cpu_amx() is true and amx_supports(type); the caller has checked the arguments.
void linear_quant_amx(float* y, int64_t ldy, const float* x, int64_t ldx, int32_t M, const uint8_t* w,
                      int64_t wrow_bytes, QuantType type, int32_t N, int32_t K, const float* bias,
                      int num_threads);

// Asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM), once per process; true if
// granted (or not needed). False on other systems and architectures.
bool amx_permitted();

}  // namespace pyengine::kernels::cpu
