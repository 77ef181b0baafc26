// The AVX2 + FMA + F16C build of the linear kernels; dispatched to only on CPUs that have it.
// The same structure as linear_avx512.cpp (M == 1: one weight row at a time, in order, several
// steps in flight; M >= 2: tiles of x rows by weight rows, the weights read once), with 8-wide
// vectors. AVX2 has no byte-masked loads: a row's last partial step goes through a zero-padded
// copy on the stack.
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "isa_target.h"
#include "linear_common.h"
#include "pyengine/cpu_isa.h"

#if !PYENGINE_ISA_X86
#define PYENGINE_ISA_NS isa_avx2
#include "linear_generic_impl.h"
#else
#include <immintrin.h>

PYENGINE_ISA_BEGIN_AVX2
namespace pyengine::kernels::cpu::isa_avx2 {

namespace {

constexpr int64_t kPrefetchBytes = 4096;
constexpr int32_t kStep = 16;  // columns per FMA pair (bf16: one 32-byte load)

#include "simd_x86.h"

// 16 weights times 16 columns of x into acc. bf16: a 32-byte load holds, in each 32-bit lane j,
// element 2j (low half) and 2j + 1 (high half); a shift by 16 gives the even elements as fp32,
// a mask the odd ones. x is stored to match (x group 16: the 8 even columns, then the 8 odd).
inline void fma16(__m256& acc, const float* x, const uint16_t* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), acc);
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_castsi256_ps(_mm256_and_si256(v, high)),
                        acc);
}

inline void fma16(__m256& acc, const float* x, const float* w) {
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(w), acc);
  acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(w + 8), acc);
}

// The weights [k, K) of a row (fewer than kStep), zero-padded to kStep.
template <typename W>
struct Tail {
  alignas(32) W v[kStep];
  Tail(const W* w, int32_t cols) {
    std::memset(v, 0, sizeof(v));
    std::memcpy(v, w, sizeof(W) * cols);
  }
};

// M == 1: one weight row at a time, 4 accumulators, software prefetch `Locality` (__builtin_prefetch's:
// 3 into L1, 2 into L2; -1 none) `Ahead` bytes ahead of the step being read.
template <typename W, int Locality, int64_t Ahead>
void rows_m1_prefetching(const LinearArgs& a, int32_t n0, int32_t n1) {
  const int32_t K = a.K;
  const float* x = a.xf;
  for (int32_t n = n0; n < n1; ++n) {
    const W* w = static_cast<const W*>(a.w) + static_cast<int64_t>(n) * K;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    int32_t k = 0;
    for (; k + 4 * kStep <= K; k += 4 * kStep)
      for (int u = 0; u < 4; ++u) {
        if constexpr (Locality >= 0)
          __builtin_prefetch(reinterpret_cast<const char*>(w + k + u * kStep) + Ahead, 0, Locality);
        fma16(acc[u], x + k + u * kStep, w + k + u * kStep);
      }
    for (int u = 0; k + kStep <= K; k += kStep, ++u) fma16(acc[u], x + k, w + k);
    if (k < K) fma16(acc[3], x + k, Tail<W>(w + k, K - k).v);
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    linear_store(a, 0, n, hsum8(sum));
  }
}

// The one-row pass's prefetch, by core. AMD family 0x19 (Zen 3; Zen 4 held to this level): fp32
// rows stream fastest with the hardware prefetchers alone, bf16 rows (more work per byte) with an
// L1 prefetch 1 KiB ahead. Measured on a 2-core AMD EPYC (Zen 3), the W2 model's batch-1 step in
// the engine, variants taking turns: fp32 41-44 tok/s without against 34-39 prefetching into L2
// 4 KiB ahead, bf16 70-74 against 64-68. Elsewhere (Intel cores, other AMD families: not measured
// at this level) into L2, 4 KiB ahead.
bool amd_family_19h() {
  static const bool zen = cpu_vendor() == "AuthenticAMD" && cpu_family() == 0x19;
  return zen;
}

template <typename W>
void rows_m1(const LinearArgs& a, int32_t n0, int32_t n1) {
  if (!amd_family_19h()) return rows_m1_prefetching<W, 2, kPrefetchBytes>(a, n0, n1);
  if constexpr (std::is_same_v<W, float>)
    rows_m1_prefetching<W, -1, 0>(a, n0, n1);
  else
    rows_m1_prefetching<W, 3, 1024>(a, n0, n1);
}

// Dot products of MB rows of x with R consecutive weight rows, 16 columns at a time, prefetching
// the next tile. out[m * R + r].
template <typename W, int MB, int R>
void tile(const LinearArgs& a, const float* x, const W* w, float* out) {
  const int32_t K = a.K;
  const int64_t kp = a.kp;
  __m256 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps();
  int32_t k = 0;
  for (; k + kStep <= K; k += kStep)
    for (int r = 0; r < R; ++r) {
      prefetch_l2(w + (R + r) * static_cast<int64_t>(K) + k);
      for (int m = 0; m < MB; ++m) fma16(acc[m][r], x + m * kp + k, w + r * K + k);
    }
  if (k < K)
    for (int r = 0; r < R; ++r) {
      const Tail<W> t(w + r * K + k, K - k);
      for (int m = 0; m < MB; ++m) fma16(acc[m][r], x + m * kp + k, t.v);
    }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = hsum8(acc[m][r]);
}

constexpr int kMaxMB = 3;  // x rows per tile (3 x 4 accumulators of the 16 registers)

#include "linear_tiles.h"

}  // namespace

void linear_rows(const LinearArgs& a, int32_t n0, int32_t n1) {
  if (a.bf16)
    rows<uint16_t>(a, n0, n1);
  else
    rows<float>(a, n0, n1);
}

int32_t linear_x_group(bool bf16) { return bf16 ? kStep : 0; }

}  // namespace pyengine::kernels::cpu::isa_avx2
PYENGINE_ISA_END
#endif
