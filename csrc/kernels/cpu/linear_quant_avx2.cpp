// The AVX2 + FMA + F16C build of the quantized linear kernel; dispatched to only on CPUs that
// have it (the compute code: linear_quant_avx2_impl.h).
#define PYENGINE_ISA_NS isa_avx2
#define PYENGINE_QUANT_ISA_BEGIN PYENGINE_ISA_BEGIN_AVX2
#include "linear_quant_x86_build.h"
