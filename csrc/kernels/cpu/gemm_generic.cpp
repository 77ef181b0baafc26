// The portable build of the GEMM (any CPU).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dtype_convert.h"
#include "gemm_common.h"

namespace pyengine::kernels::cpu::isa_generic {
namespace {
#include "gemm_portable.h"
#include "gemm_impl.h"
}  // namespace pyengine::kernels::cpu::isa_generic
