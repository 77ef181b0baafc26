// The aarch64 build of the linear kernels. For now the portable code, which gcc vectorizes
// with Advanced SIMD (baseline on aarch64).
#define PYENGINE_ISA_NS isa_neon
#include "linear_generic_impl.h"
