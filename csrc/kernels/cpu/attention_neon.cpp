// The aarch64 Advanced SIMD build (auto-vectorized) of the paged-attention back end;
// dispatched to only on CPUs that have it.
#include "attention_deps.h"

#define PYENGINE_ISA_NS isa_neon
PYENGINE_ISA_BEGIN_NEON
#include "attention_impl.h"
PYENGINE_ISA_END_NEON
