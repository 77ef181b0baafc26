// The AVX2 + FMA + F16C build of the fused elementwise kernels and the KV store
// (elementwise_impl.h), auto-vectorized; dispatched to only on CPUs that have it.
#include "elementwise_deps.h"

#define PYENGINE_ISA_NS isa_avx2
PYENGINE_ISA_BEGIN_AVX2
#include "elementwise_impl.h"
PYENGINE_ISA_END
