// linear_quant_amx: see linear_quant_amx.h.
//
// AMX multiplies tiles of 16 rows x 64 bytes: C[16 x 16 fp32] += A[16 x 32 bf16] B, B holding 16
// pairs of positions (k, k+1) x 16 columns (tdpbf16ps). A is x, rounded to bf16 once per call
// (row-major: a tile is 16 rows of 32 consecutive positions). B is the weights, dequantized 32
// rows (two B tiles wide) and all of K at a time into a per-thread buffer in cache, already in
// B's layout: every interleaved layout stores, per group of 8 rows, "quads" -- 32 bytes whose
// byte 4j + t is row j's level at 4 consecutive positions -- which become two B rows (pairs)
// after a conversion and one permutation. C goes to y through a small buffer (bias added, tails
// cut). A row's result depends on its own x row only: its tiles' sums run in the same order
// whatever M is.
#include "linear_quant_amx.h"

#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "column_split.h"
#include "isa_target.h"
#include "quant_blocks.h"

#if PYENGINE_ISA_X86
#include <immintrin.h>
#endif
#if PYENGINE_ISA_X86 && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pyengine::kernels::cpu {

bool amx_supports(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0x8:
    case QuantType::kQ4_0x8:
    case QuantType::kQ4_Zx8:
    case QuantType::kQ5_0x8:
    case QuantType::kQ5_1x8:
    case QuantType::kQ4_Kx8:
    case QuantType::kQ5_Kx8:
    case QuantType::kQ6_Kx8:
      return true;
    default:
      return false;
  }
}

bool amx_permitted() {
#if PYENGINE_ISA_X86 && defined(__linux__)
  // Linux gives a process the (8 KB) tile state only when asked (since 5.16).
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

#if PYENGINE_ISA_X86

PYENGINE_ISA_BEGIN_AVX512_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
namespace amx_impl {
namespace {

constexpr int kTileBytes = 1024;          // 16 rows x 64 bytes
constexpr int32_t kNTile = 32;            // weight rows dequantized at a time: two B tiles
constexpr int64_t kXPassBytes = 1 << 20;  // bf16 rows of x multiplied per pass (about half an L2)

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (A0 B0, A0 B1, A1 B0, A1 B1); 4, 5: A; 6, 7: B. All 16 rows x 64 bytes.
void load_tile_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// Per-row scale and offset of a quad, spread over its 16 fp32 lanes (row j, position t) for rows
// 0-3 (lo) and 4-7 (hi): w = level * scale - offset.
struct QuadScales {
  __m512 sc_lo, sc_hi, off_lo, off_hi;
};

inline QuadScales spread(__m256 sc, __m256 off) {
  const __m512i lo = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i hi = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
  const __m512 s = _mm512_castps256_ps512(sc), o = _mm512_castps256_ps512(off);
  return {_mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(hi, s), _mm512_permutexvar_ps(lo, o),
          _mm512_permutexvar_ps(hi, o)};
}

// The levels and scales of one group (8 rows) over 32 positions: quads q = 0..7 (positions
// 4q..4q+3), quads 0-3 scaled by s[0], 4-7 by s[1].
struct Block32 {
  __m256i q[8];
  QuadScales s[2];
  bool is_signed;
};

inline __m256 fp16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q4_0x8-style nibbles: 4 chunks of 32 bytes, chunk c holding positions 8c + t (low nibbles) and
// 8c + 4 + t (high).
inline void nibble_quads(const uint8_t* chunks, Block32& b) {
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load32(chunks + 32 * c);
    b.q[2 * c] = _mm256_and_si256(v, m4);
    b.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  }
}

// Block kb (positions 32 kb ..) of the group at g, by layout (pyengine/cpu_quant.h).
inline void block_q8_0x8(const uint8_t* g, int64_t kb, Block32& b) {
  const uint8_t* p = g + kb * static_cast<int64_t>(sizeof(BlockQ8_0x8));
  b.s[0] = b.s[1] = spread(fp16x8(p), _mm256_setzero_ps());
  for (int c = 0; c < 8; ++c) b.q[c] = load32(p + 16 + 32 * c);
  b.is_signed = true;
}

inline void block_q4_0x8(const uint8_t* g, int64_t kb, Block32& b) {
  const uint8_t* p = g + kb * static_cast<int64_t>(sizeof(BlockQ4_0x8));
  const __m256 d = fp16x8(p);
  b.s[0] = b.s[1] = spread(d, _mm256_mul_ps(d, _mm256_set1_ps(8.0f)));
  nibble_quads(p + 16, b);
  b.is_signed = false;
}

inline void block_q4_zx8(const uint8_t* g, int64_t kb, Block32& b) {
  const uint8_t* p = g + kb * static_cast<int64_t>(sizeof(BlockQ4_Zx8));
  const __m256 d = fp16x8(p);
  const __m256 z = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16))));
  b.s[0] = b.s[1] = spread(d, _mm256_mul_ps(d, z));
  nibble_quads(p + 24, b);
  b.is_signed = false;
}

// The fifth bits of 32 positions (pyengine/cpu_quant.h: bit 2c, 2c + 1 of byte 4j + t for chunk
// c's low, high nibble) or'ed into b's levels as bit 4.
inline void add_fifth_bits(const uint8_t* qh, Block32& b) {
  __m256i h = load32(qh);  // shifted right 2 bits a chunk (16-bit lanes: bits 0, 1 of a byte stay its own)
  const __m256i bit4 = _mm256_set1_epi8(0x10);
  for (int c = 0; c < 4; ++c) {
    b.q[2 * c] = _mm256_or_si256(b.q[2 * c], _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
    b.q[2 * c + 1] = _mm256_or_si256(b.q[2 * c + 1], _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
    h = _mm256_srli_epi16(h, 2);
  }
}

// Q5_0x8 (levels less 16) and Q5_1x8 (levels plus each row's m)
template <typename B>
inline void block_q5_x8(const uint8_t* g, int64_t kb, Block32& b) {
  const uint8_t* p = g + kb * static_cast<int64_t>(sizeof(B));
  const __m256 d = fp16x8(p);
  const B& blk = *reinterpret_cast<const B*>(p);
  if constexpr (std::is_same_v<B, BlockQ5_1x8>)
    b.s[0] = b.s[1] = spread(d, _mm256_sub_ps(_mm256_setzero_ps(), fp16x8(p + 16)));
  else
    b.s[0] = b.s[1] = spread(d, _mm256_mul_ps(d, _mm256_set1_ps(16.0f)));
  nibble_quads(blk.qs, b);
  add_fifth_bits(blk.qh, b);
  b.is_signed = false;
}

// Q4_Kx8, and Q5_Kx8 (its Q4_Kx8 part, the fifth bits of each level added as bit 4)
template <typename B>
inline void block_k_min_x8(const uint8_t* g, int64_t kb, Block32& b) {
  const uint8_t* p = g + kb / 8 * static_cast<int64_t>(sizeof(B));
  const int s = static_cast<int>(kb % 8);  // the sub-block
  const __m256 d = fp16x8(p), dmin = fp16x8(p + 16);
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32 + 8 * s))));
  // mins[pair][row][2]: row j's min of sub-block s is the low (s even) or high byte of word j
  const __m256i mw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 96 + 16 * (s / 2))));
  const __m256i mi = _mm256_and_si256(_mm256_srli_epi32(mw, 8 * (s % 2)), _mm256_set1_epi32(0xff));
  b.s[0] = b.s[1] = spread(_mm256_mul_ps(d, sc), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mi)));
  nibble_quads(p + 160 + 128 * s, b);
  if constexpr (std::is_same_v<B, BlockQ5_Kx8>) add_fifth_bits(p + sizeof(BlockQ4_Kx8) + 32 * s, b);
  b.is_signed = false;
}

inline void block_q6_kx8(const uint8_t* g, int64_t kb, Block32& b) {
  const uint8_t* p = g + kb / 8 * static_cast<int64_t>(sizeof(BlockQ6_Kx8));
  const int pr = static_cast<int>(kb % 8);  // sub-blocks 2 pr, 2 pr + 1
  const __m256 d = fp16x8(p);
  // scales[pair][row][2] (int8): row j's pair is word j
  const __m256i sw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 + 16 * pr)));
  const __m256i s0 = _mm256_srai_epi32(_mm256_slli_epi32(sw, 24), 24);
  const __m256i s1 = _mm256_srai_epi32(_mm256_slli_epi32(sw, 16), 24);
  const __m256 thirty_two = _mm256_set1_ps(32.0f);
  const __m256 d0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s0)), d1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(s1));
  b.s[0] = spread(d0, _mm256_mul_ps(d0, thirty_two));
  b.s[1] = spread(d1, _mm256_mul_ps(d1, thirty_two));
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  for (int u = 0; u < 2; ++u) {
    const uint8_t* sb = p + 144 + 96 * (2 * pr + u);
    const __m256i a = load32(sb), bb = load32(sb + 32), h = load32(sb + 64);
    b.q[4 * u + 0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x03)), 4));
    b.q[4 * u + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                     _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x0c)), 2));
    b.q[4 * u + 2] = _mm256_or_si256(_mm256_and_si256(bb, m4), _mm256_and_si256(h, _mm256_set1_epi8(0x30)));
    b.q[4 * u + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bb, 4), m4),
                                     _mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(static_cast<char>(0xc0))), 2));
  }
  b.is_signed = false;
}

inline void block_of(QuantType type, const uint8_t* g, int64_t kb, Block32& b) {
  switch (type) {
    case QuantType::kQ8_0x8: return block_q8_0x8(g, kb, b);
    case QuantType::kQ4_0x8: return block_q4_0x8(g, kb, b);
    case QuantType::kQ4_Zx8: return block_q4_zx8(g, kb, b);
    case QuantType::kQ5_0x8: return block_q5_x8<BlockQ5_0x8>(g, kb, b);
    case QuantType::kQ5_1x8: return block_q5_x8<BlockQ5_1x8>(g, kb, b);
    case QuantType::kQ4_Kx8: return block_k_min_x8<BlockQ4_Kx8>(g, kb, b);
    case QuantType::kQ5_Kx8: return block_k_min_x8<BlockQ5_Kx8>(g, kb, b);
    default: return block_q6_kx8(g, kb, b);
  }
}

// Quad q of b as bf16: dword 2j + h = row j's positions 4q + 2h, 4q + 2h + 1.
inline __m512i quad_bf16(const Block32& b, int q) {
  const QuadScales& s = b.s[q / 4];
  const __m128i lo8 = _mm256_castsi256_si128(b.q[q]), hi8 = _mm256_extracti128_si256(b.q[q], 1);
  const __m512i lo = b.is_signed ? _mm512_cvtepi8_epi32(lo8) : _mm512_cvtepu8_epi32(lo8);
  const __m512i hi = b.is_signed ? _mm512_cvtepi8_epi32(hi8) : _mm512_cvtepu8_epi32(hi8);
  const __m512 vlo = _mm512_fmsub_ps(_mm512_cvtepi32_ps(lo), s.sc_lo, s.off_lo);
  const __m512 vhi = _mm512_fmsub_ps(_mm512_cvtepi32_ps(hi), s.sc_hi, s.off_hi);
  return (__m512i)_mm512_cvtne2ps_pbh(vhi, vlo);  // low half from vlo
}

// Groups g0, g1 (8 rows each; g1 may be null: zeros) over positions 32 kb.. as one B tile.
inline void b_tile(QuantType type, const uint8_t* g0, const uint8_t* g1, int64_t kb, uint8_t* tile) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  Block32 b0, b1;
  block_of(type, g0, kb, b0);
  if (g1 != nullptr) block_of(type, g1, kb, b1);
  for (int q = 0; q < 8; ++q) {
    const __m512i d = quad_bf16(b0, q);
    const __m512i e = g1 != nullptr ? quad_bf16(b1, q) : _mm512_setzero_si512();
    _mm512_store_si512(tile + 64 * (2 * q), _mm512_permutex2var_epi32(d, even, e));
    _mm512_store_si512(tile + 64 * (2 * q + 1), _mm512_permutex2var_epi32(d, odd, e));
  }
}

// x rows [m0, m1) -> bf16 rows of K at xb (rows K apart); rows from M on are zeros.
void x_to_bf16(const float* x, int64_t ldx, int32_t M, int32_t m0, int32_t m1, int32_t K, uint16_t* xb) {
  for (int32_t m = m0; m < m1; ++m) {
    uint16_t* dst = xb + static_cast<int64_t>(m) * K;
    if (m >= M) {
      std::memset(dst, 0, sizeof(uint16_t) * K);
      continue;
    }
    const float* src = x + m * ldx;
    for (int32_t k = 0; k < K; k += 32) {
      const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + k + 16), _mm512_loadu_ps(src + k));
      _mm512_storeu_si512(dst + k, v);
    }
  }
}

// C tile (16 x 16 fp32 at c) -> y rows [m, m + rows), columns [n, n + cols), plus bias.
inline void store_c(const float* c, float* y, int64_t ldy, int32_t m, int32_t rows, int32_t n, int32_t cols,
                    const float* bias) {
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
  for (int32_t r = 0; r < rows; ++r)
    _mm512_mask_storeu_ps(y + (m + r) * ldy + n, mask, _mm512_add_ps(_mm512_load_ps(c + 16 * r), b));
}

struct Job {
  float* y;
  int64_t ldy;
  const uint16_t* xb;  // [Mp, K] bf16
  int32_t M, N, K;
  const uint8_t* w;
  int64_t group_bytes;  // 8 rows
  QuantType type;
  const float* bias;
};

// Weight rows [n, n + cols) (cols <= 32, a multiple of 8) against x rows [m0, m1).
void n_tile(const Job& j, int32_t n, int32_t cols, int32_t m0, int32_t m1, uint8_t* wbuf, float* cbuf) {
  const int32_t KB = j.K / 32;
  const uint8_t* g[4] = {};
  for (int32_t i = 0; i < cols / 8; ++i) g[i] = j.w + (n / 8 + i) * j.group_bytes;
  for (int32_t kb = 0; kb < KB; ++kb) {
    b_tile(j.type, g[0], g[1], kb, wbuf + (2 * kb) * kTileBytes);
    if (g[2] != nullptr)
      b_tile(j.type, g[2], g[3], kb, wbuf + (2 * kb + 1) * kTileBytes);
    else
      std::memset(wbuf + (2 * kb + 1) * kTileBytes, 0, kTileBytes);
  }
  const int64_t lda = static_cast<int64_t>(j.K) * 2;
  const char* xb = reinterpret_cast<const char*>(j.xb);
  for (int32_t m = m0; m < m1; m += 32) {
    const int32_t rows0 = std::min(16, m1 - m), rows1 = std::min(16, m1 - m - 16);
    const char* a0 = xb + m * lda;
    const char* a1 = rows1 > 0 ? a0 + 16 * lda : a0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int32_t kb = 0; kb < KB; ++kb) {
      _tile_loadd(4, a0 + 64 * kb, lda);
      _tile_loadd(5, a1 + 64 * kb, lda);
      _tile_loadd(6, wbuf + (2 * kb) * kTileBytes, 64);
      _tile_loadd(7, wbuf + (2 * kb + 1) * kTileBytes, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, cbuf, 64);
    _tile_stored(1, cbuf + 256, 64);
    _tile_stored(2, cbuf + 512, 64);
    _tile_stored(3, cbuf + 768, 64);
    const int32_t cols0 = std::min(16, cols), cols1 = cols - 16;
    store_c(cbuf, j.y, j.ldy, m, rows0, n, cols0, j.bias);
    if (cols1 > 0) store_c(cbuf + 256, j.y, j.ldy, m, rows0, n + 16, cols1, j.bias);
    if (rows1 > 0) {
      store_c(cbuf + 512, j.y, j.ldy, m + 16, rows1, n, cols0, j.bias);
      if (cols1 > 0) store_c(cbuf + 768, j.y, j.ldy, m + 16, rows1, n + 16, cols1, j.bias);
    }
  }
}

}  // namespace

void run(float* y, int64_t ldy, const float* x, int64_t ldx, int32_t M, const uint8_t* w, int64_t wrow_bytes,
         QuantType type, int32_t N, int32_t K, const float* bias, int num_threads) {
  const int32_t Mp = (M + 15) / 16 * 16;
  static thread_local std::vector<uint16_t> xbuf;  // the calling thread's; its workers use it too
  xbuf.resize(static_cast<size_t>(Mp) * K);
  uint16_t* xb = xbuf.data();
  const Job job{y, ldy, xb, M, N, K, w, 8 * wrow_bytes, type, bias};
  // rows of x per pass: their bf16 stays in cache while each thread's weight tiles go past
  const int32_t pass = static_cast<int32_t>(std::max<int64_t>(32, kXPassBytes / (2 * K) / 32 * 32));
  const int32_t tiles = (N + kNTile - 1) / kNTile;
  const int nt = std::max(1, std::min(num_threads, tiles));
PYENGINE_OMP(parallel num_threads(nt))
  {
    const int t = thread_id(), T = team_size();
    const GroupRange rows = thread_groups(Mp, t, T);
    x_to_bf16(x, ldx, M, rows.begin, rows.end, K, xb);
PYENGINE_OMP(barrier)
    static thread_local std::vector<uint8_t> wmem;
    wmem.resize(static_cast<size_t>(K / 32) * 2 * kTileBytes + 64 + 4 * kTileBytes + 64);
    uint8_t* wbuf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(wmem.data()) + 63) & ~uintptr_t{63});
    float* cbuf = reinterpret_cast<float*>(wbuf + static_cast<size_t>(K / 32) * 2 * kTileBytes);
    const GroupRange mine = thread_groups(tiles, t, T);
    load_tile_config();
    for (int32_t m0 = 0; m0 < M; m0 += pass)
      for (int32_t i = mine.begin; i < mine.end; ++i) {
        const int32_t n = i * kNTile;
        n_tile(job, n, std::min(kNTile, N - n), m0, std::min(M, m0 + pass), wbuf, cbuf);
      }
    _tile_release();
  }
}

}  // namespace amx_impl
PYENGINE_ISA_END

void linear_quant_amx(float* y, int64_t ldy, const float* x, int64_t ldx, int32_t M, const uint8_t* w,
                      int64_t wrow_bytes, QuantType type, int32_t N, int32_t K, const float* bias,
                      int num_threads) {
  amx_impl::run(y, ldy, x, ldx, M, w, wrow_bytes, type, N, K, bias, num_threads);
}

#else  // another architecture: never called (cpu_amx() is false)

void linear_quant_amx(float*, int64_t, const float*, int64_t, int32_t, const uint8_t*, int64_t, QuantType,
                      int32_t, int32_t, const float*, int) {}

#endif

}  // namespace pyengine::kernels::cpu
