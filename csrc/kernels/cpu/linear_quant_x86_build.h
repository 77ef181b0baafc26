// One x86 build of the quantized linear kernel's compute code (linear_quant_avx2_impl.h), for the
// translation unit that includes this: it defines PYENGINE_ISA_NS (the level's namespace),
// PYENGINE_QUANT_ISA_BEGIN (the level's PYENGINE_ISA_BEGIN_* macro) and, for a VNNI build,
// PYENGINE_QUANT_VNNI (1: AVX-VNNI, 2: AVX512-VNNI). On another architecture the namespace
// holds the portable build (never dispatched to).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa_target.h"
#include "linear_quant_common.h"

#if !PYENGINE_ISA_X86
#include "linear_quant_generic_impl.h"
#else
#include <immintrin.h>

PYENGINE_QUANT_ISA_BEGIN
#include "linear_quant_avx2_impl.h"
PYENGINE_ISA_END
#endif
