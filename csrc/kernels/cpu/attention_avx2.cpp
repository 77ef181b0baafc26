// The AVX2 + FMA + F16C build (auto-vectorized) of the paged-attention back end;
// dispatched to only on CPUs that have it.
#include "attention_deps.h"

#define PYENGINE_ISA_NS isa_avx2
PYENGINE_ISA_BEGIN_AVX2
#include "attention_impl.h"
PYENGINE_ISA_END
