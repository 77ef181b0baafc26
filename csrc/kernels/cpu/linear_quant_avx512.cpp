// The AVX-512 build of the quantized linear kernel: the AVX2 compute code
// (linear_quant_avx2_impl.h) compiled for the AVX-512 level; dispatched to only on CPUs that
// have it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa_target.h"
#include "linear_quant_common.h"

#define PYENGINE_ISA_NS isa_avx512
#if !PYENGINE_ISA_X86
#include "linear_quant_generic_impl.h"
#else
#include <immintrin.h>

PYENGINE_ISA_BEGIN_AVX512
#include "linear_quant_avx2_impl.h"
PYENGINE_ISA_END
#endif
