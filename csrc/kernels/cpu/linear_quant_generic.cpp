// The portable build of the quantized linear kernel (any CPU).
#define PYENGINE_ISA_NS isa_generic
#include "linear_quant_generic_impl.h"
