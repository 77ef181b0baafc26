// The aarch64 Advanced SIMD build of the linear kernels (armv8-a baseline intrinsics only: no
// bf16 or dot-product extensions), dispatched to at level neon. The same structure as
// linear_avx2.cpp (M == 1: one weight row at a time, in order, several independent accumulators;
// M >= 2: tiles of up to 4 x rows by 4 weight rows, so each weight row is read once whatever M
// is), with 4-wide vectors. A row's last partial step goes through a zero-padded copy on the
// stack, so no load reads past the end of a weight row.
//
// Not tuned on aarch64 hardware (checked for correctness under qemu-aarch64 only): no software
// prefetch, the hardware prefetchers are left to follow the sequential weight rows.
//
// On x86-64 (and on big-endian aarch64, where the even/odd lane split below would not hold)
// this namespace holds the portable build, which is never dispatched to on x86-64.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "isa_target.h"
#include "linear_common.h"

#if !PYENGINE_ISA_ARM || defined(__AARCH64EB__)
#define PYENGINE_ISA_NS isa_neon
#include "linear_generic_impl.h"
#else
#include <arm_neon.h>

PYENGINE_ISA_BEGIN_NEON
namespace pyengine::kernels::cpu::isa_neon {

namespace {

constexpr int32_t kStep = 8;  // columns per step (bf16: one 16-byte load; fp32: two)

// 8 weights of a row as two fp32 vectors, in the order x is stored in.
struct W8 {
  float32x4_t lo, hi;
};

// bf16: a 16-byte load holds, in each 32-bit lane j, element 2j (low half) and 2j + 1 (high
// half). A shift left by 16 gives the even elements as fp32, a mask of the high half the odd
// ones; x is stored to match (x group 8: the 4 even columns, then the 4 odd ones).
inline W8 load8(const uint16_t* w) {
  const uint32x4_t v = vreinterpretq_u32_u16(vld1q_u16(w));
  return {vreinterpretq_f32_u32(vshlq_n_u32(v, 16)),
          vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xffff0000u)))};
}

inline W8 load8(const float* w) { return {vld1q_f32(w), vld1q_f32(w + 4)}; }

// acc += the 8 columns of x at `x` times w.
inline void fma8(float32x4_t& acc, const float* x, const W8& w) {
  acc = vfmaq_f32(acc, vld1q_f32(x), w.lo);
  acc = vfmaq_f32(acc, vld1q_f32(x + 4), w.hi);
}

// The same into two accumulators (two independent FMA chains instead of one).
inline void fma8(float32x4_t& acc_lo, float32x4_t& acc_hi, const float* x, const W8& w) {
  acc_lo = vfmaq_f32(acc_lo, vld1q_f32(x), w.lo);
  acc_hi = vfmaq_f32(acc_hi, vld1q_f32(x + 4), w.hi);
}

// The weights [k, K) of a row (fewer than kStep), zero-padded to kStep.
template <typename W>
struct Tail {
  alignas(16) W v[kStep];
  Tail(const W* w, int32_t cols) {
    std::memset(v, 0, sizeof(v));
    std::memcpy(v, w, sizeof(W) * cols);
  }
};

template <typename W>
void rows_m1(const LinearArgs& a, int32_t n0, int32_t n1) {
  const int32_t K = a.K;
  const float* x = a.xf;
  for (int32_t n = n0; n < n1; ++n) {
    const W* w = static_cast<const W*>(a.w) + static_cast<int64_t>(n) * K;
    float32x4_t acc[8];  // 8 independent FMA chains
    for (auto& v : acc) v = vdupq_n_f32(0.0f);
    int32_t k = 0;
    for (; k + 4 * kStep <= K; k += 4 * kStep)
      for (int u = 0; u < 4; ++u)
        fma8(acc[2 * u], acc[2 * u + 1], x + k + u * kStep, load8(w + k + u * kStep));
    // at most 3 whole steps left, then the tail
    for (int u = 0; k + kStep <= K; k += kStep, ++u)
      fma8(acc[2 * u], acc[2 * u + 1], x + k, load8(w + k));
    if (k < K) fma8(acc[6], acc[7], x + k, load8(Tail<W>(w + k, K - k).v));
    const float32x4_t s0 = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
    const float32x4_t s1 = vaddq_f32(vaddq_f32(acc[4], acc[5]), vaddq_f32(acc[6], acc[7]));
    linear_store(a, 0, n, vaddvq_f32(vaddq_f32(s0, s1)));
  }
}

// Dot products of MB rows of x with R consecutive weight rows, 8 columns at a time; each step
// of weights is loaded (and widened) once for the MB rows of x. out[m * R + r].
template <typename W, int MB, int R>
void tile(const LinearArgs& a, const float* x, const W* w, float* out) {
  const int32_t K = a.K;
  const int64_t kp = a.kp;
  float32x4_t acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vdupq_n_f32(0.0f);
  int32_t k = 0;
  for (; k + kStep <= K; k += kStep)
    for (int r = 0; r < R; ++r) {
      const W8 wv = load8(w + static_cast<int64_t>(r) * K + k);
      for (int m = 0; m < MB; ++m) fma8(acc[m][r], x + m * kp + k, wv);
    }
  if (k < K)
    for (int r = 0; r < R; ++r) {
      const Tail<W> t(w + static_cast<int64_t>(r) * K + k, K - k);
      const W8 wv = load8(t.v);
      for (int m = 0; m < MB; ++m) fma8(acc[m][r], x + m * kp + k, wv);
    }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = vaddvq_f32(acc[m][r]);
}

// 4 x 4 accumulators, 2 weight vectors and 2 x vectors: 20 of the 32 vector registers.
constexpr int kMaxMB = 4;  // x rows per tile

#include "linear_tiles.h"

}  // namespace

void linear_rows(const LinearArgs& a, int32_t n0, int32_t n1) {
  if (a.bf16)
    rows<uint16_t>(a, n0, n1);
  else
    rows<float>(a, n0, n1);
}

int32_t linear_x_group(bool bf16) { return bf16 ? kStep : 0; }

}  // namespace pyengine::kernels::cpu::isa_neon
PYENGINE_ISA_END_NEON
#endif
