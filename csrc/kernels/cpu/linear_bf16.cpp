// linear_bf16: y = x . W^T (+ bias) in bf16 for a few rows of x (decode), fp32 accumulation.
//
// At batch 1 a linear layer is a GEMV: each weight element is used once per row of x, so the
// kernel is bound by how fast it streams W from DRAM. The x rows are converted to fp32 once
// (zero-padded to a multiple of 16 columns) and shared by all threads; each thread takes a
// contiguous range of output columns (weight rows) and computes every x row against a weight
// row while it is in cache, so W is read from memory once whatever M is.
//
// Two builds of the inner loop, chosen at run time (cpu_isa.h): AVX-512 (bf16 -> fp32 by
// zero-extension and a 16-bit shift, FMA into several accumulators) and portable C++.

// Standard / OpenMP / intrinsics headers first, so none of their inline code is compiled for
// AVX-512 by the target pragma below.
#include <omp.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PYENGINE_LINEAR_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_isa.h"
#include "dtype_convert.h"
#include "pyengine/cpu_linear.h"

namespace pyengine::kernels {

namespace {

using cpu::bf16_to_f32;
using cpu::f32_to_bf16;

// Column padding of the fp32 copy of x: a full step (32 columns) past K reads zeros.
constexpr int32_t kPad = 32;
// Below this many weight elements a call runs on one thread (a fork/join costs more).
constexpr int64_t kMinParallelElems = 1 << 15;
// Output columns handed to a thread are a multiple of this (the weight-row tile).
constexpr int32_t kColumnGrain = 4;

struct Args {
  uint16_t* y;
  const float* xf;  // [M, kp] fp32 (see prepare_x), zero-padded columns K..kp-1
  int64_t kp;
  const uint16_t* w;
  const uint16_t* bias;
  int32_t M, N, K;
};

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// Rounds `acc` (+ bias) to bf16 into y[m, n].
inline void store(const Args& a, int32_t m, int32_t n, float acc) {
  if (a.bias != nullptr) acc += bf16_to_f32(a.bias[n]);
  a.y[static_cast<int64_t>(m) * a.N + n] = f32_to_bf16(acc);
}

// ---- portable build ----

// Weight rows [n0, n1), all rows of x. Sixteen partial sums per dot product, written so the
// compiler can vectorize them without reassociating (no -ffast-math needed).
void rows_generic(const Args& a, int32_t n0, int32_t n1) {
  constexpr int32_t kSums = 16;
  static thread_local std::vector<float> wrow;
  wrow.assign(static_cast<size_t>(a.kp), 0.0f);
  for (int32_t n = n0; n < n1; ++n) {
    const uint16_t* w = a.w + static_cast<int64_t>(n) * a.K;
    for (int32_t k = 0; k < a.K; ++k) wrow[k] = bf16_to_f32(w[k]);
    for (int32_t m = 0; m < a.M; ++m) {
      const float* x = a.xf + m * a.kp;
      float acc[kSums] = {};
      for (int64_t k = 0; k < a.kp; k += kSums)
        for (int32_t j = 0; j < kSums; ++j) acc[j] += x[k + j] * wrow[k + j];
      for (int32_t s = kSums / 2; s > 0; s /= 2)
        for (int32_t j = 0; j < s; ++j) acc[j] += acc[j + s];
      store(a, m, n, acc[0]);
    }
  }
}

}  // namespace

// ---- AVX-512 build ----
#ifdef PYENGINE_LINEAR_AVX512
#pragma GCC push_options
// gcc 12 false positive inside its own AVX-512 headers (_mm512_undefined_ps)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512")
namespace {

// Software prefetch (into L2) this far ahead of the weight reads. Measured on a 2-core
// Xeon (Sapphire Rapids class): with it one core streams bf16 weights as fast as torch's
// fp32 GEMV streams fp32 ones (~15 GB/s); the hardware prefetchers alone reach ~11.
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_l2(const uint16_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
}

// A 64-byte load of 32 bf16 holds, in each 32-bit lane j, element 2j in the low half and
// 2j + 1 in the high half: a shift left by 16 gives the even elements as fp32, a mask of the
// high half the odd ones (2 integer ops per 32 weights instead of a widening shuffle per 16).
// x is stored to match (prepare_x: per 32 columns, the 16 even ones, then the 16 odd ones).
inline void fma_bf16x32(__m512& acc, const float* x, const uint16_t* w, __mmask32 mask) {
  const __m512i v = _mm512_maskz_loadu_epi16(mask, w);
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(x), _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), acc);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), _mm512_castsi512_ps(_mm512_and_si512(v, high)),
                        acc);
}

inline __mmask32 tail_mask(int32_t cols) { return static_cast<__mmask32>((1ull << cols) - 1u); }

// M == 1: one weight row at a time, read strictly in order (what the prefetchers follow
// best), 4 steps of 32 columns in flight in independent accumulators.
void rows_m1_avx512(const Args& a, int32_t n0, int32_t n1) {
  const int32_t K = a.K;
  const float* x = a.xf;
  for (int32_t n = n0; n < n1; ++n) {
    const uint16_t* w = a.w + static_cast<int64_t>(n) * K;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    int32_t k = 0;
    for (; k + 4 * kPad <= K; k += 4 * kPad)
      for (int u = 0; u < 4; ++u) {
        prefetch_l2(w + k + u * kPad + kPrefetchBytes / 2);
        fma_bf16x32(acc[u], x + k + u * kPad, w + k + u * kPad, ~0u);
      }
    for (int u = 0; k + kPad <= K; k += kPad, ++u) fma_bf16x32(acc[u], x + k, w + k, ~0u);
    if (k < K) fma_bf16x32(acc[3], x + k, w + k, tail_mask(K - k));
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    store(a, 0, n, _mm512_reduce_add_ps(sum));
  }
}

// M >= 2: dot products of MB rows of x with R consecutive weight rows, 32 columns at a time
// (R weight loads, 2 MB x loads and 2 MB R FMAs per step; at most 16 accumulators), prefetching
// the next tile. out[m * R + r].
template <int MB, int R>
void tile_avx512(const Args& a, const float* x, const uint16_t* w, float* out) {
  const int32_t K = a.K;
  const int64_t kp = a.kp;
  __m512 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int32_t k = 0; k < K; k += kPad) {
    const __mmask32 mask = K - k >= kPad ? ~0u : tail_mask(K - k);
    for (int r = 0; r < R; ++r) {
      prefetch_l2(w + (R + r) * static_cast<int64_t>(K) + k);
      for (int m = 0; m < MB; ++m) fma_bf16x32(acc[m][r], x + m * kp + k, w + r * K + k, mask);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) out[m * R + r] = _mm512_reduce_add_ps(acc[m][r]);
}

using TileFn = void (*)(const Args&, const float*, const uint16_t*, float*);

// Up to 4 x rows at a time; a weight-row tile is then in L1 for the next x rows.
constexpr int kMaxMB = 4;

template <int R>
TileFn tile_for(int mb) {
  switch (mb) {
    case 1: return tile_avx512<1, R>;
    case 2: return tile_avx512<2, R>;
    case 3: return tile_avx512<3, R>;
    default: return tile_avx512<4, R>;
  }
}

// Weight rows [n0, n1), all rows of x.
void rows_avx512(const Args& a, int32_t n0, int32_t n1) {
  if (a.M == 1) return rows_m1_avx512(a, n0, n1);
  constexpr int32_t R = kColumnGrain;
  float out[kMaxMB * R];
  auto run = [&](int32_t n, int32_t rows, TileFn (*pick)(int)) {
    const uint16_t* w = a.w + static_cast<int64_t>(n) * a.K;
    for (int32_t m0 = 0; m0 < a.M; m0 += kMaxMB) {
      const int32_t mb = std::min(kMaxMB, a.M - m0);
      pick(mb)(a, a.xf + m0 * a.kp, w, out);
      for (int32_t m = 0; m < mb; ++m)
        for (int32_t r = 0; r < rows; ++r) store(a, m0 + m, n + r, out[m * rows + r]);
    }
  };
  int32_t n = n0;
  for (; n + R <= n1; n += R) run(n, R, tile_for<R>);
  for (; n < n1; ++n) run(n, 1, tile_for<1>);
}

}  // namespace
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif  // PYENGINE_LINEAR_AVX512

namespace {

bool use_avx512() {
#ifdef PYENGINE_LINEAR_AVX512
  return cpu::cpu_has_avx512();
#else
  return false;
#endif
}

// xf[m, :] = x[m, :] as fp32, zero-padded to kp columns. For the AVX-512 build each block of
// 32 columns holds its even columns first, then its odd ones (see tile_avx512).
void prepare_x(std::vector<float>& xf, const uint16_t* x, int32_t M, int32_t K, int64_t kp,
               bool even_odd) {
  xf.assign(static_cast<size_t>(M * kp), 0.0f);
  for (int32_t m = 0; m < M; ++m) {
    const uint16_t* src = x + static_cast<int64_t>(m) * K;
    float* dst = xf.data() + m * kp;
    for (int32_t k = 0; k < K; ++k) {
      const int32_t j = k % kPad;
      const int64_t at = even_odd ? k - j + (j % 2) * (kPad / 2) + j / 2 : k;
      dst[at] = bf16_to_f32(src[k]);
    }
  }
}

}  // namespace

const char* linear_bf16_isa() { return use_avx512() ? "avx512" : "generic"; }

void linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
                 int32_t M, int32_t N, int32_t K, int32_t num_threads) {
  if (y == nullptr) fail("y: must not be null");
  if (x == nullptr) fail("x: must not be null");
  if (weight == nullptr) fail("weight: must not be null");
  if (M < 1 || M > kLinearBf16MaxRows)
    fail("M: must be in 1.." + std::to_string(kLinearBf16MaxRows) + ", got " + std::to_string(M));
  if (N < 1) fail("N: must be > 0, got " + std::to_string(N));
  if (K < 1) fail("K: must be > 0, got " + std::to_string(K));

  const bool avx512 = use_avx512();
  // x -> fp32 once, zero-padded; reused across calls by the calling thread.
  static thread_local std::vector<float> xf;
  const int64_t kp = (static_cast<int64_t>(K) + kPad - 1) / kPad * kPad;
  prepare_x(xf, x, M, K, kp, avx512);

  const Args a{y, xf.data(), kp, weight, bias, M, N, K};
  void (*rows)(const Args&, int32_t, int32_t) = rows_generic;
#ifdef PYENGINE_LINEAR_AVX512
  if (avx512) rows = rows_avx512;
#endif
  int nt = num_threads > 0 ? num_threads : omp_get_max_threads();
  if (static_cast<int64_t>(N) * K < kMinParallelElems) nt = 1;
  nt = std::max(1, std::min(nt, (N + kColumnGrain - 1) / kColumnGrain));
  if (nt == 1) {
    rows(a, 0, N);
    return;
  }
  // Contiguous column ranges, a multiple of kColumnGrain each (the last one takes the rest).
  const int32_t groups = (N + kColumnGrain - 1) / kColumnGrain;
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    const int T = omp_get_num_threads();
    const int32_t g0 = static_cast<int32_t>(static_cast<int64_t>(groups) * t / T);
    const int32_t g1 = static_cast<int32_t>(static_cast<int64_t>(groups) * (t + 1) / T);
    rows(a, g0 * kColumnGrain, std::min(N, g1 * kColumnGrain));
  }
}

}  // namespace pyengine::kernels
