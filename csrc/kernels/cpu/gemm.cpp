// gemm_f32 / gemm_bf16: see pyengine/cpu_gemm.h. The front end: argument checks, one parallel
// region in which the threads first pack x into panels (the level's panel height) and then each
// computes a contiguous range of output columns (weight rows) from all panels.
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "column_split.h"
#include "gemm_common.h"
#include "isa_target.h"
#include "linear_checks.h"
#include "pyengine/cpu_gemm.h"

namespace pyengine::kernels {

namespace {

using cpu::GemmArgs;

struct LevelFns {
  int32_t (*panel_rows)();
  int32_t (*column_grain)();
  void (*pack)(const GemmArgs&, int32_t);
  void (*columns)(const GemmArgs&, int32_t, int32_t, float*);
};

#define PYENGINE_GEMM_LEVEL(ns) \
  LevelFns{cpu::ns::gemm_panel_rows, cpu::ns::gemm_column_grain, cpu::ns::gemm_pack, cpu::ns::gemm_columns}

// The active level's compute code (cpu_isa() throws here, before any thread starts, if
// PYENGINE_CPU_ISA is invalid).
LevelFns level_fns() {
  switch (cpu_isa()) {
    case CpuIsa::kAvx512:
      return PYENGINE_GEMM_LEVEL(isa_avx512);
    case CpuIsa::kAvx2:
      return PYENGINE_GEMM_LEVEL(isa_avx2);
    case CpuIsa::kNeon:
      return PYENGINE_GEMM_LEVEL(isa_neon);
    default:
      return PYENGINE_GEMM_LEVEL(isa_generic);
  }
}

#undef PYENGINE_GEMM_LEVEL

// Below this many multiply-adds a call runs on one thread (a fork/join costs more).
constexpr int64_t kMinParallelMacs = 1 << 18;

template <typename T>
void gemm(T* y, const T* x, const T* weight, const T* bias, int32_t M, int32_t N, int32_t K,
          int32_t num_threads) {
  cpu::check_linear_args(y, x, weight, M, 0, N, K);
  const LevelFns fns = level_fns();
  const int32_t P = fns.panel_rows();
  const int32_t grain = fns.column_grain();
  const int32_t panels = (M + P - 1) / P;
  // the packed panels, reused across calls by the calling thread
  static thread_local std::vector<float> xp;
  xp.resize(static_cast<size_t>(panels) * K * P);
  const GemmArgs a{x, xp.data(), weight, bias, y, sizeof(T) == 2, M, N, K};

  const int32_t groups = (N + grain - 1) / grain;
  int nt = cpu::resolve_threads(num_threads);
  if (static_cast<int64_t>(M) * N * K < kMinParallelMacs) nt = 1;
  nt = std::max(1, std::min(nt, groups));
  // bf16: each thread's weight rows widened to fp32
  static thread_local std::vector<float> wide;
  const int64_t wide_per_thread = sizeof(T) == 2 ? static_cast<int64_t>(grain) * K : 0;
  wide.resize(static_cast<size_t>(wide_per_thread * nt));
  float* const wide_all = wide.data();  // (inside the region `wide` would name each thread's own)
  if (nt == 1) {
    for (int32_t p = 0; p < panels; ++p) fns.pack(a, p);
    fns.columns(a, 0, N, wide_all);
    return;
  }
PYENGINE_OMP(parallel num_threads(nt))
  {
    const int t = cpu::thread_id();
    const int T_ = cpu::team_size();
    for (int32_t p = t; p < panels; p += T_) fns.pack(a, p);
PYENGINE_OMP(barrier)
    const cpu::GroupRange g = cpu::thread_groups(groups, t, T_);
    if (g.begin < g.end) fns.columns(a, g.begin * grain, std::min(N, g.end * grain), wide_all + t * wide_per_thread);
  }
}

}  // namespace

bool gemm_routed() {
  const CpuIsa isa = cpu_isa();
  return isa == CpuIsa::kAvx2 || isa == CpuIsa::kAvx512;
}

bool gemm_preferred(int32_t rows) { return rows >= kGemmMinRows && gemm_routed(); }

void gemm_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M,
              int32_t N, int32_t K, int32_t num_threads) {
  gemm(y, x, weight, bias, M, N, K, num_threads);
}

void gemm_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
               int32_t M, int32_t N, int32_t K, int32_t num_threads) {
  gemm(y, x, weight, bias, M, N, K, num_threads);
}

}  // namespace pyengine::kernels
