// The AVX2 + FMA + F16C build of the quantized linear kernel; dispatched to only on CPUs that
// have it (the compute code: linear_quant_avx2_impl.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa_target.h"
#include "linear_quant_common.h"

#define PYENGINE_ISA_NS isa_avx2
#if !PYENGINE_ISA_X86
#include "linear_quant_generic_impl.h"
#else
#include <immintrin.h>

PYENGINE_ISA_BEGIN_AVX2
#include "linear_quant_avx2_impl.h"
PYENGINE_ISA_END
#endif
