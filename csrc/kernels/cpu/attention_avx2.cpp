// The AVX2 + FMA + F16C build (a hand-written block kernel for the rows of a query position,
// the rest auto-vectorized) of the paged-attention back end;
// dispatched to only on CPUs that have it.
#include "attention_deps.h"

#if PYENGINE_ISA_X86
#define PYENGINE_ATTN_AVX2 1
#endif
#define PYENGINE_ISA_NS isa_avx2
PYENGINE_ISA_BEGIN_AVX2
#include "attention_impl.h"
PYENGINE_ISA_END
