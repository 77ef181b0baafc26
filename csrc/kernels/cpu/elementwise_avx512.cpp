// The AVX-512 build of the fused elementwise kernels and the KV store
// (elementwise_impl.h), auto-vectorized; dispatched to only on CPUs that have it.
#include "elementwise_deps.h"

#define PYENGINE_ISA_NS isa_avx512
PYENGINE_ISA_BEGIN_AVX512
#include "elementwise_impl.h"
PYENGINE_ISA_END
