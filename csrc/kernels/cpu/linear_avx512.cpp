// The AVX-512 build of the linear kernels; dispatched to only on CPUs that have it.
//
// At batch 1 a linear layer is a GEMV: each weight element is used once per row of x, so the
// kernel is bound by how fast it streams W from DRAM. M == 1 reads one weight row at a time,
// strictly in order (what the hardware prefetchers follow best), several steps in flight in
// independent accumulators; M >= 2 computes tiles of up to 4 x rows by 4 weight rows, so each
// weight row is read from memory once whatever M is. fp32 tiles load each step's weight
// vectors once, into registers, for all the tile's x rows: on a 2-core AMD EPYC twice as fast
// at 4 rows as loading them per x row. From M == 2 on, every output is the same sum in the same
// order whatever M is: a row's result does not depend on the rows batched with it. (Tiles of 8
// weight rows at M == 1 would extend that to M == 1, at a few percent of W2's decode speed.)
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "isa_target.h"
#include "linear_common.h"

#if !PYENGINE_ISA_X86
#define PYENGINE_ISA_NS isa_avx512
#include "linear_generic_impl.h"
#else
#include <immintrin.h>

PYENGINE_ISA_BEGIN_AVX512
namespace pyengine::kernels::cpu::isa_avx512 {

namespace {

// Software prefetch this far ahead of the weight reads (into L2 for the tiles, into L1 for the
// M == 1 loops). Measured on a 2-core Xeon (Sapphire Rapids class): with it one core streams
// bf16 weights as fast as torch's fp32 GEMV streams fp32 ones (~15 GB/s); the hardware
// prefetchers alone reach ~11.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int32_t kPad = kLinearPad;

#include "simd_x86.h"

inline __mmask32 tail_mask(int32_t cols) { return static_cast<__mmask32>((1ull << cols) - 1u); }

// 32 weights of a row times 32 columns of x, into acc. A 64-byte load of 32 bf16 holds, in each
// 32-bit lane j, element 2j in the low half and 2j + 1 in the high half: a shift left by 16 gives
// the even elements as fp32, a mask of the high half the odd ones (2 integer ops per 32 weights
// instead of a widening shuffle per 16). x is stored to match (x group 32: per 32 columns, the
// 16 even ones, then the 16 odd ones).
inline void fma32(__m512& acc, const float* x, const uint16_t* w, __mmask32 mask) {
  const __m512i v = _mm512_maskz_loadu_epi16(mask, w);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), acc);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), _mm512_castsi512_ps(_mm512_and_si512(v, high)),
                        acc);
}

// fp32 weights: two 16-wide FMAs (the mask covers 32 columns, 16 per half).
inline void fma32(__m512& acc, const float* x, const float* w, __mmask32 mask) {
  const __mmask16 lo = static_cast<__mmask16>(mask), hi = static_cast<__mmask16>(mask >> 16);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_maskz_loadu_ps(lo, w), acc);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), _mm512_maskz_loadu_ps(hi, w + 16), acc);
}

// fp32 weights: 16 columns a step; the step's R weight vectors are loaded once, into registers,
// and used by every x row (MB * R accumulators + R weights + 1 x: at most 29 registers).
template <int MB, int R>
void tile_f32(const LinearArgs& a, const float* x, const float* w, float* out) {
  const int32_t K = a.K;
  const int64_t kp = a.kp;
  __m512 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int32_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      prefetch_l2(w + (R + r) * static_cast<int64_t>(K) + k);
      wv[r] = _mm512_maskz_loadu_ps(mask, w + r * static_cast<int64_t>(K) + k);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * kp + k);  // (zero-padded past K)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// fp32 weights, M == 1: one FMA per 16 columns into 4 independent accumulators, every weight
// line prefetched into L1 kPrefetchBytes ahead. On a 2-core AMD EPYC (Zen 5) this streams
// 1.3-1.45x as fast as the bf16 loop's shape below (two chained FMAs per 32 columns, a prefetch
// every other line) did for fp32.
void rows_m1_f32(const LinearArgs& a, int32_t n0, int32_t n1) {
  const int32_t K = a.K;
  const float* x = a.xf;
  for (int32_t n = n0; n < n1; ++n) {
    const float* w = static_cast<const float*>(a.w) + static_cast<int64_t>(n) * K;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    int32_t k = 0;
    for (; k + 64 <= K; k += 64)
      for (int u = 0; u < 4; ++u) {
        _mm_prefetch(reinterpret_cast<const char*>(w + k + 16 * u) + kPrefetchBytes, _MM_HINT_T0);
        acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16 * u), _mm512_loadu_ps(w + k + 16 * u), acc[u]);
      }
    for (int u = 0; k < K; k += 16, ++u) {  // at most 4 steps; x is zero-padded past K
      const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
      acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_maskz_loadu_ps(mask, w + k), acc[u]);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    linear_store(a, 0, n, _mm512_reduce_add_ps(sum));
  }
}

// bf16 weights, M == 1: each 64-byte load of 32 weights feeds two FMAs (even and odd
// elements, see fma32) into accumulators of their own, 8 in all, so no FMA waits for another;
// every weight line prefetched into L1 kPrefetchBytes ahead (5-10% faster than chaining the two
// FMAs and prefetching into L2, on a Zen 5 EPYC).
void rows_m1_bf16(const LinearArgs& a, int32_t n0, int32_t n1) {
  const int32_t K = a.K;
  const float* x = a.xf;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  for (int32_t n = n0; n < n1; ++n) {
    const uint16_t* w = static_cast<const uint16_t*>(a.w) + static_cast<int64_t>(n) * K;
    __m512 acc[8];
    for (auto& v : acc) v = _mm512_setzero_ps();
    int32_t k = 0;
    for (; k + 4 * kPad <= K; k += 4 * kPad)
      for (int u = 0; u < 4; ++u) {
        const uint16_t* wu = w + k + u * kPad;
        const float* xu = x + k + u * kPad;
        _mm_prefetch(reinterpret_cast<const char*>(wu) + kPrefetchBytes, _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(wu);
        acc[2 * u] = _mm512_fmadd_ps(_mm512_loadu_ps(xu), _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), acc[2 * u]);
        acc[2 * u + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(xu + 16), _mm512_castsi512_ps(_mm512_and_si512(v, high)),
                                         acc[2 * u + 1]);
      }
    for (int u = 0; k < K; k += kPad, ++u) fma32(acc[2 * u], x + k, w + k, K - k >= kPad ? ~0u : tail_mask(K - k));
    __m512 sum = acc[0];
    for (int i = 1; i < 8; ++i) sum = _mm512_add_ps(sum, acc[i]);
    linear_store(a, 0, n, _mm512_reduce_add_ps(sum));
  }
}

template <typename W>
void rows_m1(const LinearArgs& a, int32_t n0, int32_t n1) {
  if constexpr (std::is_same_v<W, float>)
    rows_m1_f32(a, n0, n1);
  else
    rows_m1_bf16(a, n0, n1);
}

// Dot products of MB rows of x with R consecutive weight rows, 32 columns at a time, prefetching
// the next tile. out[m * R + r].
template <typename W, int MB, int R>
void tile(const LinearArgs& a, const float* x, const W* w, float* out) {
  if constexpr (std::is_same_v<W, float>) return tile_f32<MB, R>(a, x, w, out);
  const int32_t K = a.K;
  const int64_t kp = a.kp;
  __m512 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int32_t k = 0; k < K; k += kPad) {
    const __mmask32 mask = K - k >= kPad ? ~0u : tail_mask(K - k);
    for (int r = 0; r < R; ++r) {
      prefetch_l2(w + (R + r) * static_cast<int64_t>(K) + k);
      for (int m = 0; m < MB; ++m) fma32(acc[m][r], x + m * kp + k, w + r * K + k, mask);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

constexpr int kMaxMB = 4;  // x rows per tile; the weight tile is then in L1 for the next x rows

#include "linear_tiles.h"

}  // namespace

void linear_rows(const LinearArgs& a, int32_t n0, int32_t n1) {
  if (a.bf16)
    rows<uint16_t>(a, n0, n1);
  else
    rows<float>(a, n0, n1);
}

int32_t linear_x_group(bool bf16) { return bf16 ? 32 : 0; }

}  // namespace pyengine::kernels::cpu::isa_avx512
PYENGINE_ISA_END
#endif
