// How a kernel gets one build per instruction-set level (see pyengine/cpu_isa.h).
//
// A kernel's compute code lives in a header (`*_impl.h`) that defines its entry points inside
// `namespace pyengine::kernels::cpu::PYENGINE_ISA_NS`. One small translation unit per level
// includes it between PYENGINE_ISA_BEGIN_<LEVEL> and PYENGINE_ISA_END, which switch gcc's target
// for the code in between: the rest of the binary stays baseline, and a level's code only runs
// after the dispatcher (PYENGINE_ISA_CALL) has checked that the CPU has it.
//
// Include standard, OpenMP and intrinsics headers *before* PYENGINE_ISA_BEGIN_*: inline code
// they define would otherwise be compiled for the level and could be shared (ODR-merged) with
// baseline callers. Everything in the impl headers has internal linkage or lives in the level's
// own namespace for the same reason.
#pragma once

#include "pyengine/cpu_isa.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define PYENGINE_ISA_X86 1
#endif
#if defined(__aarch64__)
#define PYENGINE_ISA_ARM 1
#endif

#define PYENGINE_PRAGMA(x) _Pragma(#x)

#if PYENGINE_ISA_X86 && defined(__clang__)
// clang has no `#pragma GCC target`: it gives every function in between the target attribute.
#define PYENGINE_ISA_BEGIN_TARGET(features) \
  PYENGINE_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define PYENGINE_ISA_BEGIN_AVX512_TARGET(features) PYENGINE_ISA_BEGIN_TARGET(features)
#define PYENGINE_ISA_END _Pragma("clang attribute pop")
#elif PYENGINE_ISA_X86
#define PYENGINE_ISA_BEGIN_TARGET(features)                  \
  _Pragma("GCC push_options") _Pragma("GCC diagnostic push") \
  PYENGINE_PRAGMA(GCC target(features))
// gcc 12 warns falsely inside its own AVX-512 headers (_mm512_undefined_ps).
#define PYENGINE_ISA_BEGIN_AVX512_TARGET(features)                    \
  _Pragma("GCC push_options") _Pragma("GCC diagnostic push")          \
  _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")               \
  _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")         \
  PYENGINE_PRAGMA(GCC target(features, "prefer-vector-width=512"))
#define PYENGINE_ISA_END _Pragma("GCC diagnostic pop") _Pragma("GCC pop_options")
#endif

#if PYENGINE_ISA_X86
#define PYENGINE_ISA_BEGIN_AVX2 PYENGINE_ISA_BEGIN_TARGET("avx2,fma,f16c")
#define PYENGINE_ISA_BEGIN_AVX512 \
  PYENGINE_ISA_BEGIN_AVX512_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
// The quantized kernels' VNNI builds (pyengine/cpu_isa.h: cpu_vnni): each level plus its VNNI.
#define PYENGINE_ISA_BEGIN_AVX2_VNNI PYENGINE_ISA_BEGIN_TARGET("avx2,fma,f16c,avxvnni")
#define PYENGINE_ISA_BEGIN_AVX512_VNNI \
  PYENGINE_ISA_BEGIN_AVX512_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#else
// Another architecture: the x86 levels' namespaces hold the portable build (never dispatched to).
#define PYENGINE_ISA_BEGIN_AVX2
#define PYENGINE_ISA_BEGIN_AVX512
#define PYENGINE_ISA_BEGIN_AVX2_VNNI
#define PYENGINE_ISA_BEGIN_AVX512_VNNI
#define PYENGINE_ISA_END
#endif
// Advanced SIMD is baseline on aarch64: the neon build needs no target switch (and on x86 its
// namespace holds the portable build, never dispatched to).
#define PYENGINE_ISA_BEGIN_NEON
#define PYENGINE_ISA_END_NEON

// Calls `fn(args...)` from the namespace of the level the kernels run at (pyengine::cpu_isa(),
// which throws if PYENGINE_CPU_ISA is invalid). Levels of another architecture never come up;
// their namespaces hold the portable build there.
#define PYENGINE_ISA_CALL(fn, ...)                                  \
  do {                                                              \
    switch (::pyengine::cpu_isa()) {                                \
      case ::pyengine::CpuIsa::kAvx512:                             \
        ::pyengine::kernels::cpu::isa_avx512::fn(__VA_ARGS__);      \
        break;                                                      \
      case ::pyengine::CpuIsa::kAvx2:                               \
        ::pyengine::kernels::cpu::isa_avx2::fn(__VA_ARGS__);        \
        break;                                                      \
      case ::pyengine::CpuIsa::kNeon:                               \
        ::pyengine::kernels::cpu::isa_neon::fn(__VA_ARGS__);        \
        break;                                                      \
      default:                                                      \
        ::pyengine::kernels::cpu::isa_generic::fn(__VA_ARGS__);     \
    }                                                               \
  } while (0)
