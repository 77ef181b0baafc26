// The aarch64 build of the quantized linear kernel: the portable code, compiled at level neon
// (Advanced SIMD is baseline there; gcc vectorizes the integer block sums).
#include "isa_target.h"
#define PYENGINE_ISA_NS isa_neon
PYENGINE_ISA_BEGIN_NEON
#include "linear_quant_generic_impl.h"
PYENGINE_ISA_END_NEON
