// Internal interface between the GEMM's front end (gemm.cpp: checks, threads, ISA dispatch)
// and its compute code per instruction-set level (gemm_<level>.cpp, from gemm_impl.h).
#pragma once

#include <cstdint>

namespace pyengine::kernels::cpu {

struct GemmArgs {
  const void* x;     // [M, K], fp32 or bf16 (as the weight)
  float* xp;         // packed x: panel p (rows p*P .. p*P+P-1) at xp + p*K*P, [K][P], rows past M 0
  const void* w;     // [N, K], fp32 or bf16
  const void* bias;  // [N] or null, as the weight
  void* y;           // [M, N], as the weight
  bool bf16;         // x, weight, bias and y are bf16 (else fp32)
  int32_t M, N, K;
};

// Each level: gemm_panel_rows() is P, the rows of x a panel holds; gemm_column_grain() the
// output columns one micro-kernel call computes (thread ranges are multiples of it);
// gemm_pack(a, p) writes panel p of xp; gemm_columns(a, n0, n1, wide) computes y[:, n0:n1]
// from the packed panels (bf16: `wide` holds gemm_column_grain() * K floats, the calling
// thread's own, for weight rows widened to fp32).
#define PYENGINE_GEMM_ENTRY_POINTS                              \
  int32_t gemm_panel_rows();                                    \
  int32_t gemm_column_grain();                                  \
  void gemm_pack(const GemmArgs& a, int32_t p);                 \
  void gemm_columns(const GemmArgs& a, int32_t n0, int32_t n1, float* wide);

namespace isa_generic { PYENGINE_GEMM_ENTRY_POINTS }
namespace isa_avx2 { PYENGINE_GEMM_ENTRY_POINTS }
namespace isa_avx512 { PYENGINE_GEMM_ENTRY_POINTS }
namespace isa_neon { PYENGINE_GEMM_ENTRY_POINTS }

#undef PYENGINE_GEMM_ENTRY_POINTS

}  // namespace pyengine::kernels::cpu
