// The AVX-512 build of the linear kernels; dispatched to only on CPUs that have it.
//
// At batch 1 a linear layer is a GEMV: each weight element is used once per row of x, so the
// kernel is bound by how fast it streams W from DRAM. M == 1 reads one weight row at a time,
// strictly in order (what the hardware prefetchers follow best), several steps in flight in
// independent accumulators; M >= 2 computes tiles of up to 4 x rows by 4 weight rows, so each
// weight row is read from memory once whatever M is. Tiles load each step's weight vectors once
// (bf16: widened to fp32), into registers, for all the tile's x rows: on a 2-core AMD EPYC twice
// as fast at 4 rows as loading them per x row. From M == 2 on, every output is the same sum in the same
// order whatever M is: a row's result does not depend on the rows batched with it. (Tiles of 8
// weight rows at M == 1 would extend that to M == 1, at a few percent of W2's decode speed.)
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "isa_target.h"
#include "linear_common.h"
#include "pyengine/cpu_isa.h"

#if !PYENGINE_ISA_X86
#define PYENGINE_ISA_NS isa_avx512
#include "linear_generic_impl.h"
#else
#include <immintrin.h>

PYENGINE_ISA_BEGIN_AVX512
namespace pyengine::kernels::cpu::isa_avx512 {

namespace {

// Software prefetch this far ahead of the weight reads (into L2 for the tiles; at M == 1 into L1
// on AMD cores, into L2 on Intel ones: see rows_m1). Measured on a 2-core Xeon (Sapphire Rapids
// class): with it one core streams bf16 weights as fast as torch's fp32 GEMV streams fp32 ones
// (~15 GB/s); the hardware prefetchers alone reach ~11.
constexpr int64_t kPrefetchBytes = 4096;

#include "simd_x86.h"

inline __mmask16 tail_mask16(int32_t cols) {
  return cols >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols) - 1u);
}

// 16 weights of a row as fp32: bf16 widened exactly (a 32-byte load, zero-extended to 32 bits
// and shifted into the high half), fp32 as they are; masked to the first `mask` columns.
inline __m512 wload(const float* w, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, w); }
inline __m512 wload(const uint16_t* w, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, w);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 wload(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 wload(const uint16_t* w) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// M == 1: one FMA per 16 columns into 4 independent accumulators, every 64-byte line of the
// weights prefetched kPrefetchBytes ahead with temporal locality `Locality` (3: into L1, 2: into
// L2; -1: no software prefetch, the hardware prefetchers alone). On a 2-core AMD EPYC (Zen 5) this streams fp32 weights 1.3-1.45x and bf16 ones 1.1-1.5x
// as fast as 32-column steps with two chained FMAs (bf16: even/odd halves of a 64-byte load split
// by a shift and a mask) did, prefetching into L1. On a 2-core Intel Xeon (Sapphire Rapids class, 2 MB L2) prefetching
// into L1 is the slower choice: into L2, the layers' weights (from DRAM) stream at 20-27 GB/s in
// bf16 and 25-30 in fp32 against 15-20 and 19-23 (alternating, the same process). On a 2-core
// AMD EPYC of the Zen 4 family either prefetch is the slower choice (m1_prefetch).
template <typename W, int Locality>
void rows_m1_prefetching(const LinearArgs& a, int32_t n0, int32_t n1) {
  constexpr int kStepsPerLine = 64 / (16 * static_cast<int>(sizeof(W)));  // fp32 1, bf16 2
  const int32_t K = a.K;
  const float* x = a.xf;
  for (int32_t n = n0; n < n1; ++n) {
    const W* w = static_cast<const W*>(a.w) + static_cast<int64_t>(n) * K;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    int32_t k = 0;
    for (; k + 64 <= K; k += 64)
      for (int u = 0; u < 4; ++u) {
        if constexpr (Locality >= 0)
          if (u % kStepsPerLine == 0)
            __builtin_prefetch(reinterpret_cast<const char*>(w + k + 16 * u) + kPrefetchBytes, 0, Locality);
        acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16 * u), wload(w + k + 16 * u), acc[u]);
      }
    for (int u = 0; k < K; k += 16, ++u)  // at most 4 steps; x is zero-padded past K
      acc[u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), wload(w + k, tail_mask16(K - k)), acc[u]);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    linear_store(a, 0, n, _mm512_reduce_add_ps(sum));
  }
}

}  // namespace
}  // namespace pyengine::kernels::cpu::isa_avx512
PYENGINE_ISA_END

PYENGINE_ISA_BEGIN_AVX512_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace pyengine::kernels::cpu::isa_avx512 {
namespace {

// M == 1, bf16 weights, a CPU with AVX512-BF16: vdpbf16ps multiplies 32 weights by 32 of x (bf16
// as given, a.xb; in the tail both loads masked) a step, adjacent pairs summed into each fp32
// lane, 4 independent accumulators; prefetching as rows_m1_prefetching. Half the instructions of
// widening each weight and FMA'ing it: on a 2-core AMD EPYC (Zen 4) a W5 step's layers (bf16,
// from DRAM) streamed 1.15-1.2x as fast as the widening kernel, both without software prefetch
// (scratch loop, variants taking turns). The products are exact (bf16 times bf16); the sums are fp32 in another order than the
// widening kernel's (and, as the instruction does, with denormal inputs and results flushed to zero).
inline __m512 pairs_step(__m512 acc, __m512i xv, __m512i wv) {
  return _mm512_dpbf16_ps(acc, (__m512bh)xv, (__m512bh)wv);
}

template <int Locality>
void rows_m1_bf16_pairs(const LinearArgs& a, int32_t n0, int32_t n1) {
  const int32_t K = a.K;
  const uint16_t* x = a.xb;
  for (int32_t n = n0; n < n1; ++n) {
    const uint16_t* w = static_cast<const uint16_t*>(a.w) + static_cast<int64_t>(n) * K;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    int32_t k = 0;
    for (; k + 128 <= K; k += 128)
      for (int u = 0; u < 4; ++u) {
        if constexpr (Locality >= 0)
          __builtin_prefetch(reinterpret_cast<const char*>(w + k + 32 * u) + kPrefetchBytes, 0, Locality);
        acc[u] = pairs_step(acc[u], _mm512_loadu_si512(x + k + 32 * u), _mm512_loadu_si512(w + k + 32 * u));
      }
    for (int u = 0; k < K; k += 32, ++u) {  // at most 4 steps
      const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (K - k)) - 1u);
      acc[u] = pairs_step(acc[u], _mm512_maskz_loadu_epi16(mask, x + k), _mm512_maskz_loadu_epi16(mask, w + k));
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    linear_store(a, 0, n, _mm512_reduce_add_ps(sum));
  }
}

}  // namespace
}  // namespace pyengine::kernels::cpu::isa_avx512
PYENGINE_ISA_END

PYENGINE_ISA_BEGIN_AVX512
namespace pyengine::kernels::cpu::isa_avx512 {
namespace {

// The M == 1 kernels' software prefetch on this CPU: into L2 on Intel cores, none on AMD's Zen 4
// (family 0x19: measured on a 2-core EPYC, W5's layers streamed from DRAM in a scratch loop,
// variants taking turns: without it 1.2-1.3x as fast as into L1, 1.15-1.2x as into L2), into L1
// on later AMD cores (Zen 5, above).
int m1_prefetch_locality() {
  static const int locality = cpu_vendor() != "AuthenticAMD" ? 2 : cpu_family() == 0x19 ? -1 : 3;
  return locality;
}

template <typename W, int Locality>
void rows_m1_at(const LinearArgs& a, int32_t n0, int32_t n1) {
  static const bool bf16_pairs = cpu_has_feature("avx512_bf16");
  if constexpr (std::is_same_v<W, uint16_t>)
    if (bf16_pairs) return rows_m1_bf16_pairs<Locality>(a, n0, n1);
  rows_m1_prefetching<W, Locality>(a, n0, n1);
}

template <typename W>
void rows_m1(const LinearArgs& a, int32_t n0, int32_t n1) {
  switch (m1_prefetch_locality()) {
    case -1: return rows_m1_at<W, -1>(a, n0, n1);
    case 2: return rows_m1_at<W, 2>(a, n0, n1);
    default: return rows_m1_at<W, 3>(a, n0, n1);
  }
}

// Dot products of MB rows of x with R consecutive weight rows, 16 columns a step: the step's R
// weight vectors are loaded (bf16: widened) once, into registers, and used by every x row
// (MB * R accumulators + R weights + 1 x: at most 21 registers); the next tile is prefetched
// into L2. out[m * R + r].
template <typename W, int MB, int R>
void tile(const LinearArgs& a, const float* x, const W* w, float* out) {
  const int32_t K = a.K;
  const int64_t kp = a.kp;
  __m512 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int32_t k = 0; k < K; k += 16) {
    const __mmask16 mask = tail_mask16(K - k);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) {
      if (k % (64 / sizeof(W)) == 0) prefetch_l2(w + (R + r) * static_cast<int64_t>(K) + k);
      wv[r] = wload(w + r * static_cast<int64_t>(K) + k, mask);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * kp + k);  // (zero-padded past K)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
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

int32_t linear_x_group(bool) { return 0; }

}  // namespace pyengine::kernels::cpu::isa_avx512
PYENGINE_ISA_END
#endif
