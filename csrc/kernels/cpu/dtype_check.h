// Argument check shared by the CPU kernels' entry points.
#pragma once

#include "pyengine/kernels.h"

namespace pyengine::kernels::cpu {

// Throws std::invalid_argument naming `name` unless `dtype` is one the CPU kernels compute
// in (float32, bfloat16, float16).
void check_dtype(DType dtype, const char* name);

}  // namespace pyengine::kernels::cpu
