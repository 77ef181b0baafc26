// Run-time choice of the CPU kernels' instruction set, shared by every kernel with an AVX-512
// build (defined in paged_attention.cpp).
#pragma once

namespace pyengine::kernels::cpu {

// True on CPUs with avx512f/bw/vl/dq, unless PYENGINE_DISABLE_AVX512 is set to a value other
// than "" or "0" (tests, debugging). Read once per process.
bool cpu_has_avx512();

}  // namespace pyengine::kernels::cpu
