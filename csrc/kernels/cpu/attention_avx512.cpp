// AVX-512 build of the paged-attention back end, selected at run time (paged_attention.cpp)
// only on CPUs that report avx512f/bw/vl. The rest of the binary stays baseline x86-64.
#if defined(__x86_64__) && defined(__GNUC__)

// Standard / OpenMP headers first, so none of their inline code is compiled for AVX-512.
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_common.h"

#pragma GCC push_options
// gcc 12 false positive inside its own AVX-512 headers (_mm512_undefined_ps)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")
#define PYENGINE_ATTN_ENTRY attention_run_avx512
#define PYENGINE_ATTN_AVX512 1
#include "attention_impl.h"
#pragma GCC diagnostic pop
#pragma GCC pop_options

#else  // not x86-64 gcc/clang: never selected at run time, forward to the generic build

#include "attention_common.h"

namespace pyengine::kernels::cpu {
void attention_run_avx512(const AttnParams& p) { attention_run_generic(p); }
}  // namespace pyengine::kernels::cpu

#endif
