// The AVX-512 + AVX512-VNNI build of the quantized linear kernel (Ice Lake and later, Zen 4 and
// later); dispatched to at level avx512 when cpu_vnni() says so.
#define PYENGINE_ISA_NS isa_avx512_vnni
#define PYENGINE_QUANT_ISA_BEGIN PYENGINE_ISA_BEGIN_AVX512_VNNI
#define PYENGINE_QUANT_VNNI 2  // AVX512-VNNI
#include "linear_quant_x86_build.h"
