// The AVX2 + AVX-VNNI build of the quantized linear kernel (vpdpbusd on 256-bit vectors, VEX
// encoded: Alder Lake and later, Zen 5); dispatched to at level avx2 when cpu_vnni() says so.
#define PYENGINE_ISA_NS isa_avx2_vnni
#define PYENGINE_QUANT_ISA_BEGIN PYENGINE_ISA_BEGIN_AVX2_VNNI
#define PYENGINE_QUANT_VNNI 1  // AVX-VNNI
#include "linear_quant_x86_build.h"
