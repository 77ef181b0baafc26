// The portable build (any CPU) of the fused elementwise kernels and the KV store
// (elementwise_impl.h).
#include "elementwise_deps.h"

#define PYENGINE_ISA_NS isa_generic
#include "elementwise_impl.h"
