// The portable build of the linear kernels (any CPU).
#define PYENGINE_ISA_NS isa_generic
#include "linear_generic_impl.h"
