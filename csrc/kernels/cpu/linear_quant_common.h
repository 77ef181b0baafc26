// Internal interface between the quantized linear kernel's front end (linear_quant.cpp: checks,
// activations quantized once, threads, ISA dispatch) and its compute code per instruction-set
// level (linear_quant_<level>.cpp).
#pragma once

#include <cstdint>

#include "pyengine/cpu_quant.h"
#include "quant_blocks.h"

namespace pyengine::kernels::cpu {

struct QuantLinearArgs {
  float* y;  // [M, N], rows ldy apart
  int64_t ldy;
  // x quantized: M rows of xrow_bytes, each ActQ8_32[K / 32] (Q8_0, Q5_0, Q5_1, Q4_0, Q4_Z weights)
  // or ActQ8_256[K / 256] (Q4_K, Q5_K, Q6_K weights and their interleaved layouts)
  const uint8_t* xq;
  int64_t xrow_bytes;
  const uint8_t* w;  // [N] rows of wrow_bytes
  int64_t wrow_bytes;
  QuantType type;
  const float* bias;  // [N] or null
  int32_t M, N, K;
  // M = 1 in the avx512 VNNI build, Q4_Kx8 / Q6_Kx8: x's 4-byte groups spread for the block-pair
  // kernels (spread_activation_pairs; each thread's own copy, linear_quant.cpp), else null
  const uint8_t* xspread = nullptr;
};

// spread_activation_pairs' output: per pair of 256-value blocks (a lone last block counts as
// one), 64 bytes for each of a block's 64 groups of 4 (kSpreadGroupBytes), then what the Q4_K
// pair kernel scales its sums with, lanes 0-7 the first block's, 8-15 the second's: per pair p of
// sub-blocks the sums of x over sub-blocks 2p and 2p + 1 as int16 pairs (at kSpreadSums, 64 bytes
// each), and x's scales d (at kSpreadD, 64 bytes).
constexpr int64_t kSpreadGroupBytes = kQKK / 4 * 64;
constexpr int64_t kSpreadSums = kSpreadGroupBytes, kSpreadD = kSpreadSums + 4 * 64;
constexpr int64_t kSpreadPairBytes = kSpreadD + 64;
static inline int64_t spread_activation_bytes(int64_t K) { return (K / kQKK + 1) / 2 * kSpreadPairBytes; }

// Activation blocks used with weights of `type`: 32 (ActQ8_32) or 256 (ActQ8_256) values each.
static inline int32_t act_block_elems(QuantType type) {
  type = plain_type(type);
  return type == QuantType::kQ4_K || type == QuantType::kQ5_K || type == QuantType::kQ6_K ? kQKK : kQK;
}

// Bytes of one row of K activations in blocks of `block` (32 or 256) values.
static inline int64_t act_row_bytes(int32_t block, int64_t K) {
  return block == kQK ? K / kQK * static_cast<int64_t>(sizeof(ActQ8_32))
                      : K / kQKK * static_cast<int64_t>(sizeof(ActQ8_256));
}

static inline void quant_linear_store(const QuantLinearArgs& a, int32_t m, int32_t n, float acc) {
  a.y[m * a.ldy + n] = a.bias != nullptr ? acc + a.bias[n] : acc;
}

// Rows [m0, m1) of x into activation blocks with a level's row quantizers (row32 for blocks of
// 32 values, row256 for 256).
template <typename Row32, typename Row256>
inline void quantize_activation_rows(const float* x, int64_t ldx, int32_t m0, int32_t m1, int32_t K, int32_t block,
                                     uint8_t* xq, int64_t xrow_bytes, Row32 row32, Row256 row256) {
  for (int32_t m = m0; m < m1; ++m) {
    if (block == kQK)
      row32(x + m * ldx, reinterpret_cast<ActQ8_32*>(xq + m * xrow_bytes), K);
    else
      row256(x + m * ldx, reinterpret_cast<ActQ8_256*>(xq + m * xrow_bytes), K);
  }
}

// Each level: the weight rows [n0, n1) against every row of x; rows [m0, m1) of x (K values
// each, rows ldx apart) into 8-bit blocks of 32 (ActQ8_32) or 256 (ActQ8_256) values, rows
// xrow_bytes apart, as quantize_act_32 / quantize_act_256 do, bit for bit, at every level.
#define PYENGINE_QUANT_LINEAR_ENTRY_POINTS                                                      \
  void quant_linear_rows(const QuantLinearArgs& a, int32_t n0, int32_t n1);                     \
  void quantize_activations(const float* x, int64_t ldx, int32_t m0, int32_t m1, int32_t K,     \
                            int32_t block, uint8_t* xq, int64_t xrow_bytes);

namespace isa_generic { PYENGINE_QUANT_LINEAR_ENTRY_POINTS }
namespace isa_avx2 { PYENGINE_QUANT_LINEAR_ENTRY_POINTS }
namespace isa_avx512 { PYENGINE_QUANT_LINEAR_ENTRY_POINTS }
namespace isa_neon { PYENGINE_QUANT_LINEAR_ENTRY_POINTS }
// the x86 levels with VNNI (pyengine/cpu_isa.h: cpu_vnni)
namespace isa_avx2_vnni { PYENGINE_QUANT_LINEAR_ENTRY_POINTS }
namespace isa_avx512_vnni {
PYENGINE_QUANT_LINEAR_ENTRY_POINTS
// One row of x in ActQ8_256 blocks spread for the one-row Q4_K / Q6_K kernels that sum two
// blocks at once (linear_quant_x16_avx512_impl.h): for each pair of blocks b, b + 1 and each
// 4-byte group j of a block, 64 bytes -- group j of block b repeated in lanes 0-7, of block b + 1
// (a lone last block: b again) in lanes 8-15.
void spread_activation_pairs(const uint8_t* xq, int32_t K, uint8_t* out);
}

#undef PYENGINE_QUANT_LINEAR_ENTRY_POINTS

}  // namespace pyengine::kernels::cpu
