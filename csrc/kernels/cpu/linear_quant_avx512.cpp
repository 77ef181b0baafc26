// The AVX-512 build of the quantized linear kernel: the AVX2 compute code
// (linear_quant_avx2_impl.h) compiled for the AVX-512 level; dispatched to only on CPUs that
// have it.
#define PYENGINE_ISA_NS isa_avx512
#define PYENGINE_QUANT_ISA_BEGIN PYENGINE_ISA_BEGIN_AVX512
#include "linear_quant_x86_build.h"
