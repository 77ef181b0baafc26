// The argument checks the linear front ends (linear.cpp, gemm.cpp) share. Baseline code: include
// it from front ends only, never between PYENGINE_ISA_BEGIN_* and PYENGINE_ISA_END.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pyengine::kernels::cpu {

// y = x . W^T with x [M, K], W [N, K]: non-null pointers, 1 <= M (<= max_rows where max_rows > 0),
// N, K >= 1. Throws std::invalid_argument naming the argument.
inline void check_linear_args(const void* y, const void* x, const void* weight, int32_t M, int32_t max_rows,
                              int32_t N, int32_t K) {
  const auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (y == nullptr) fail("y: must not be null");
  if (x == nullptr) fail("x: must not be null");
  if (weight == nullptr) fail("weight: must not be null");
  if (max_rows > 0 && (M < 1 || M > max_rows))
    fail("M: must be in 1.." + std::to_string(max_rows) + ", got " + std::to_string(M));
  if (M < 1) fail("M: must be > 0, got " + std::to_string(M));
  if (N < 1) fail("N: must be > 0, got " + std::to_string(N));
  if (K < 1) fail("K: must be > 0, got " + std::to_string(K));
}

}  // namespace pyengine::kernels::cpu
