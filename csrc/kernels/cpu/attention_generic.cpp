// The portable build of the paged-attention back end (any CPU).
#include "attention_deps.h"

#define PYENGINE_ISA_NS isa_generic
#include "attention_impl.h"
