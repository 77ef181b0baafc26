// The AVX-512 build (hand-written block kernels) of the paged-attention back end;
// dispatched to only on CPUs that have it.
#include "attention_deps.h"

#if PYENGINE_ISA_X86
#define PYENGINE_ATTN_AVX512 1
#endif
#define PYENGINE_ISA_NS isa_avx512
PYENGINE_ISA_BEGIN_AVX512
#include "attention_impl.h"
PYENGINE_ISA_END
