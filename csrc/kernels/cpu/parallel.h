// The kernels' threads: OpenMP when the library is built with it (PYENGINE_OPENMP), else every
// kernel runs on the calling thread. Kernels call these instead of omp_get_*(), and write their
// parallel regions as PYENGINE_OMP(parallel for ...), which expands to nothing without OpenMP (a
// bare `#pragma omp` would trip -Wunknown-pragmas). Results do not depend on the thread count:
// every kernel computes each row or column with the same code whichever thread takes it.
//
// Included before PYENGINE_ISA_BEGIN_* (isa_target.h): <omp.h> and the inline functions here
// must stay baseline code.
#pragma once

#if defined(_OPENMP)
#include <omp.h>
#endif

#define PYENGINE_PRAGMA_(...) _Pragma(#__VA_ARGS__)
#if defined(_OPENMP)
#define PYENGINE_OMP(...) PYENGINE_PRAGMA_(omp __VA_ARGS__)
#else
#define PYENGINE_OMP(...)
#endif

namespace pyengine::kernels::cpu {

// The threads a kernel plans for when its caller asks for `requested` (<= 0: OpenMP's default).
// Without OpenMP always 1, so that a kernel whose plan depends on it (paged attention's split-K)
// plans exactly as an OpenMP build asked for one thread does.
static inline int resolve_threads(int requested) {
#if defined(_OPENMP)
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

// The calling thread's index in the current parallel region (0 outside one, or without OpenMP).
static inline int thread_id() {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Threads of the current parallel region (1 outside one, or without OpenMP).
static inline int team_size() {
#if defined(_OPENMP)
  return omp_get_num_threads();
#else
  return 1;
#endif
}

}  // namespace pyengine::kernels::cpu
