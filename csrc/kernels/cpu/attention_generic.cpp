// Baseline-ISA build of the paged-attention back end (runs on any x86-64 / other CPU).
#define PYENGINE_ATTN_ENTRY attention_run_generic
#include "attention_impl.h"
