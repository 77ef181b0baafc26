// Conversions between llama.cpp's row layouts and pyengine's interleaved ones (8 rows side by
// side, see pyengine/cpu_quant.h), through each block's levels and scales: scalar code, run once
// at load time (and by the portable kernel and dequantization).
#include "quant_interleave.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "quant_blocks.h"

namespace pyengine::kernels {

namespace cpu {

namespace {

// ---- the levels of one plain block ----

// Q4_0 and Q4_Z: low nibble i = weight i, high nibble i = weight 16 + i
template <typename B>
void nibble_levels(const B& b, uint8_t* L) {
  for (int i = 0; i < kQK / 2; ++i) L[i] = b.qs[i] & 0x0f, L[i + kQK / 2] = b.qs[i] >> 4;
}
template <typename B>
void set_nibble_levels(B& b, const uint8_t* L) {
  for (int i = 0; i < kQK / 2; ++i) b.qs[i] = static_cast<uint8_t>(L[i] | (L[i + kQK / 2] << 4));
}
// Q6_K: position 128h + 32k + l sits in ql[64h + l (+ 32 for k = 1, 3)], low (k = 0, 1) or high
// nibble, and bits 2k, 2k + 1 of qh[32h + l].
void q6_k_levels(const BlockQ6_K& b, uint8_t* L) {
  for (int p = 0; p < kQKK; ++p) {
    const int h = p / 128, k = p % 128 / 32, l = p % 32;
    const uint8_t ql = b.ql[64 * h + l + (k & 1) * 32];
    L[p] = static_cast<uint8_t>(((k < 2 ? ql : ql >> 4) & 0x0f) | (((b.qh[32 * h + l] >> (2 * k)) & 3) << 4));
  }
}
void q6_k_set_levels(BlockQ6_K& b, const uint8_t* L) {
  std::memset(b.ql, 0, sizeof(b.ql));
  std::memset(b.qh, 0, sizeof(b.qh));
  for (int p = 0; p < kQKK; ++p) {
    const int h = p / 128, k = p % 128 / 32, l = p % 32;
    b.ql[64 * h + l + (k & 1) * 32] |= static_cast<uint8_t>((L[p] & 0x0f) << (k < 2 ? 0 : 4));
    b.qh[32 * h + l] |= static_cast<uint8_t>((L[p] >> 4) << (2 * k));
  }
}

// ---- one group block: 8 plain blocks (row r's at blocks[r]) <-> the interleaved one ----

// byte 4r + t of chunk c holds positions base + 8c + t (low nibble) and base + 8c + 4 + t (high)
void put_nibble_chunks(const uint8_t* L, int r, int positions, uint8_t* qs) {
  for (int c = 0; c < positions / 8; ++c)
    for (int t = 0; t < 4; ++t) qs[32 * c + 4 * r + t] = static_cast<uint8_t>(L[8 * c + t] | (L[8 * c + 4 + t] << 4));
}
void get_nibble_chunks(const uint8_t* qs, int r, int positions, uint8_t* L) {
  for (int c = 0; c < positions / 8; ++c)
    for (int t = 0; t < 4; ++t) L[8 * c + t] = qs[32 * c + 4 * r + t] & 0x0f, L[8 * c + 4 + t] = qs[32 * c + 4 * r + t] >> 4;
}

// 32 levels' fifth bits: byte 4r + t, bit 2c (2c + 1) from position 8c + t (8c + 4 + t), the
// positions of the low (high) nibble of byte 4r + t of chunk c (put_nibble_chunks)
void put_fifth_bits(const uint8_t* L, int r, uint8_t* qh) {
  for (int t = 0; t < 4; ++t) {
    uint8_t bits = 0;
    for (int c = 0; c < 4; ++c)
      bits = static_cast<uint8_t>(bits | ((L[8 * c + t] >> 4) << (2 * c)) | ((L[8 * c + 4 + t] >> 4) << (2 * c + 1)));
    qh[4 * r + t] = bits;
  }
}
// ... and back, or'ed into the levels' bit 4
void get_fifth_bits(const uint8_t* qh, int r, uint8_t* L) {
  for (int t = 0; t < 4; ++t)
    for (int c = 0; c < 4; ++c) {
      L[8 * c + t] = static_cast<uint8_t>(L[8 * c + t] | (((qh[4 * r + t] >> (2 * c)) & 1) << 4));
      L[8 * c + 4 + t] = static_cast<uint8_t>(L[8 * c + 4 + t] | (((qh[4 * r + t] >> (2 * c + 1)) & 1) << 4));
    }
}

template <typename Plain, typename X8>
void five_bits_to_x8(const Plain* const* in, X8& out) {
  uint8_t L[kQK];
  for (int r = 0; r < kRows8; ++r) {
    out.d[r] = in[r]->d;
    if constexpr (std::is_same_v<Plain, BlockQ5_1>) out.m[r] = in[r]->m;
    q5_levels(in[r]->qh, in[r]->qs, L);
    put_fifth_bits(L, r, out.qh);
    for (int i = 0; i < kQK; ++i) L[i] &= 0x0f;
    put_nibble_chunks(L, r, kQK, out.qs);
  }
}
template <typename Plain, typename X8>
void five_bits_from_x8(const X8& in, Plain* const* out, int r0, int r1) {
  uint8_t L[kQK];
  for (int r = r0; r < r1; ++r) {
    out[r]->d = in.d[r];
    if constexpr (std::is_same_v<Plain, BlockQ5_1>) out[r]->m = in.m[r];
    get_nibble_chunks(in.qs, r, kQK, L);
    get_fifth_bits(in.qh, r, L);
    q5_set_levels(L, out[r]->qh, out[r]->qs);
  }
}
void to_x8(const BlockQ5_0* const* in, BlockQ5_0x8& out) { five_bits_to_x8(in, out); }
void from_x8(const BlockQ5_0x8& in, BlockQ5_0* const* out, int r0, int r1) { five_bits_from_x8(in, out, r0, r1); }
void to_x8(const BlockQ5_1* const* in, BlockQ5_1x8& out) { five_bits_to_x8(in, out); }
void from_x8(const BlockQ5_1x8& in, BlockQ5_1* const* out, int r0, int r1) { five_bits_from_x8(in, out, r0, r1); }

// Q4_0 and Q4_Z (whose zero points go along; its pad byte comes back 0)
template <typename Plain, typename X8>
void nibbles_to_x8(const Plain* const* in, X8& out) {
  uint8_t L[kQK];
  for (int r = 0; r < kRows8; ++r) {
    out.d[r] = in[r]->d;
    if constexpr (std::is_same_v<Plain, BlockQ4_Z>) out.z[r] = in[r]->z;
    nibble_levels(*in[r], L);
    put_nibble_chunks(L, r, kQK, out.qs);
  }
}
template <typename Plain, typename X8>
void nibbles_from_x8(const X8& in, Plain* const* out, int r0, int r1) {
  uint8_t L[kQK];
  for (int r = r0; r < r1; ++r) {
    out[r]->d = in.d[r];
    if constexpr (std::is_same_v<Plain, BlockQ4_Z>) out[r]->z = in.z[r], out[r]->pad = 0;
    get_nibble_chunks(in.qs, r, kQK, L);
    set_nibble_levels(*out[r], L);
  }
}
void to_x8(const BlockQ4_0* const* in, BlockQ4_0x8& out) { nibbles_to_x8(in, out); }
void from_x8(const BlockQ4_0x8& in, BlockQ4_0* const* out, int r0, int r1) { nibbles_from_x8(in, out, r0, r1); }
void to_x8(const BlockQ4_Z* const* in, BlockQ4_Zx8& out) { nibbles_to_x8(in, out); }
void from_x8(const BlockQ4_Zx8& in, BlockQ4_Z* const* out, int r0, int r1) { nibbles_from_x8(in, out, r0, r1); }

// Q8_0x8: byte 4r + t of chunk c holds position 4c + t
void to_x8(const BlockQ8_0* const* in, BlockQ8_0x8& out) {
  for (int r = 0; r < kRows8; ++r) {
    out.d[r] = in[r]->d;
    for (int c = 0; c < kQK / 4; ++c) std::memcpy(out.qs + 32 * c + 4 * r, in[r]->qs + 4 * c, 4);
  }
}
void from_x8(const BlockQ8_0x8& in, BlockQ8_0* const* out, int r0, int r1) {
  for (int r = r0; r < r1; ++r) {
    out[r]->d = in.d[r];
    for (int c = 0; c < kQK / 4; ++c) std::memcpy(out[r]->qs + 4 * c, in.qs + 32 * c + 4 * r, 4);
  }
}

// Q4_Kx8, and Q5_Kx8 (Q4_Kx8's bytes for the low 4 bits, its fifth bits beside)
template <typename Plain>
void k_to_x8(const Plain* const* in, BlockQ4_Kx8& out, uint8_t (*qh)[kRows8 * kQK / 8]) {
  uint8_t L[kQKK];
  for (int r = 0; r < kRows8; ++r) {
    out.d[r] = in[r]->d;
    out.dmin[r] = in[r]->dmin;
    for (int s = 0; s < 8; ++s) {
      uint8_t sc, m;
      q4k_scale_min(s, in[r]->scales, sc, m);
      out.scales[kRows8 * s + r] = sc;
      out.mins[16 * (s / 2) + 2 * r + s % 2] = m;
    }
    k_levels(*in[r], L);
    if (qh != nullptr)
      for (int s = 0; s < 8; ++s) put_fifth_bits(L + 32 * s, r, qh[s]);
    for (int i = 0; i < kQKK; ++i) L[i] &= 0x0f;
    for (int s = 0; s < 8; ++s) put_nibble_chunks(L + 32 * s, r, 32, out.qs + 128 * s);
  }
}
template <typename Plain>
void k_from_x8(const BlockQ4_Kx8& in, const uint8_t (*qh)[kRows8 * kQK / 8], Plain* const* out, int r0, int r1) {
  uint8_t L[kQKK], sc[8], m[8];
  for (int r = r0; r < r1; ++r) {
    out[r]->d = in.d[r];
    out[r]->dmin = in.dmin[r];
    for (int s = 0; s < 8; ++s) sc[s] = in.scales[kRows8 * s + r], m[s] = in.mins[16 * (s / 2) + 2 * r + s % 2];
    q4k_pack_scale_min(sc, m, out[r]->scales);
    for (int s = 0; s < 8; ++s) get_nibble_chunks(in.qs + 128 * s, r, 32, L + 32 * s);
    if (qh != nullptr)
      for (int s = 0; s < 8; ++s) get_fifth_bits(qh[s], r, L + 32 * s);
    k_set_levels(*out[r], L);
  }
}
void to_x8(const BlockQ4_K* const* in, BlockQ4_Kx8& out) { k_to_x8(in, out, nullptr); }
void from_x8(const BlockQ4_Kx8& in, BlockQ4_K* const* out, int r0, int r1) { k_from_x8(in, nullptr, out, r0, r1); }
void to_x8(const BlockQ5_K* const* in, BlockQ5_Kx8& out) { k_to_x8(in, out.low, out.qh); }
void from_x8(const BlockQ5_Kx8& in, BlockQ5_K* const* out, int r0, int r1) { k_from_x8(in.low, in.qh, out, r0, r1); }

// Q6_Kx8 sub-block s: position 16s + 4v + t of row r in byte 4r + t of chunk A (v = 0, 1) or B
// (v = 2, 3), low nibble for even v; its top 2 bits in bits 2v, 2v + 1 of byte 4r + t of H.
void to_x8(const BlockQ6_K* const* in, BlockQ6_Kx8& out) {
  uint8_t L[kQKK];
  std::memset(out.q, 0, sizeof(out.q));
  for (int r = 0; r < kRows8; ++r) {
    out.d[r] = in[r]->d;
    for (int s = 0; s < 16; ++s) out.scales[16 * (s / 2) + 2 * r + s % 2] = in[r]->scales[s];
    q6_k_levels(*in[r], L);
    for (int s = 0; s < 16; ++s)
      for (int v = 0; v < 4; ++v)
        for (int t = 0; t < 4; ++t) {
          const uint8_t level = L[16 * s + 4 * v + t];
          out.q[s][32 * (v / 2) + 4 * r + t] |= static_cast<uint8_t>((level & 0x0f) << (v % 2 ? 4 : 0));
          out.q[s][64 + 4 * r + t] |= static_cast<uint8_t>((level >> 4) << (2 * v));
        }
  }
}
void from_x8(const BlockQ6_Kx8& in, BlockQ6_K* const* out, int r0, int r1) {
  uint8_t L[kQKK];
  for (int r = r0; r < r1; ++r) {
    out[r]->d = in.d[r];
    for (int s = 0; s < 16; ++s) out[r]->scales[s] = in.scales[16 * (s / 2) + 2 * r + s % 2];
    for (int s = 0; s < 16; ++s)
      for (int v = 0; v < 4; ++v)
        for (int t = 0; t < 4; ++t) {
          const uint8_t lo = (in.q[s][32 * (v / 2) + 4 * r + t] >> (v % 2 ? 4 : 0)) & 0x0f;
          const uint8_t hi = (in.q[s][64 + 4 * r + t] >> (2 * v)) & 3;
          L[16 * s + 4 * v + t] = static_cast<uint8_t>(lo | (hi << 4));
        }
    q6_k_set_levels(*out[r], L);
  }
}

// A whole group: its K / block_elems group blocks, each from (or to) block b of the 8 rows (back
// to rows: only rows [r0, r1)).
template <typename Plain, typename X8, bool kToX8>
void convert_group(const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t nb, int r0, int r1) {
  for (int64_t b = 0; b < nb; ++b) {
    if constexpr (kToX8) {
      const Plain* rows[kRows8];
      for (int r = 0; r < kRows8; ++r) rows[r] = reinterpret_cast<const Plain*>(src + r * row_bytes) + b;
      to_x8(rows, reinterpret_cast<X8*>(dst)[b]);
    } else {
      Plain* rows[kRows8];
      for (int r = 0; r < kRows8; ++r) rows[r] = reinterpret_cast<Plain*>(dst + r * row_bytes) + b;
      from_x8(reinterpret_cast<const X8*>(src)[b], rows, r0, r1);
    }
  }
}

template <bool kToX8>
void convert(QuantType interleaved, const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t K, int r0, int r1) {
  switch (interleaved) {
    case QuantType::kQ4_0x8: return convert_group<BlockQ4_0, BlockQ4_0x8, kToX8>(src, dst, row_bytes, K / kQK, r0, r1);
    case QuantType::kQ8_0x8: return convert_group<BlockQ8_0, BlockQ8_0x8, kToX8>(src, dst, row_bytes, K / kQK, r0, r1);
    case QuantType::kQ5_0x8: return convert_group<BlockQ5_0, BlockQ5_0x8, kToX8>(src, dst, row_bytes, K / kQK, r0, r1);
    case QuantType::kQ5_1x8: return convert_group<BlockQ5_1, BlockQ5_1x8, kToX8>(src, dst, row_bytes, K / kQK, r0, r1);
    case QuantType::kQ4_Zx8: return convert_group<BlockQ4_Z, BlockQ4_Zx8, kToX8>(src, dst, row_bytes, K / kQK, r0, r1);
    case QuantType::kQ4_Kx8: return convert_group<BlockQ4_K, BlockQ4_Kx8, kToX8>(src, dst, row_bytes, K / kQKK, r0, r1);
    case QuantType::kQ5_Kx8: return convert_group<BlockQ5_K, BlockQ5_Kx8, kToX8>(src, dst, row_bytes, K / kQKK, r0, r1);
    case QuantType::kQ6_Kx8: return convert_group<BlockQ6_K, BlockQ6_Kx8, kToX8>(src, dst, row_bytes, K / kQKK, r0, r1);
    default: throw std::invalid_argument("type: " + std::to_string(static_cast<int32_t>(interleaved)) +
                                         " is not an interleaved layout");
  }
}

}  // namespace

void interleave_group(QuantType interleaved, const uint8_t* plain, int64_t row_bytes, uint8_t* group, int64_t K) {
  convert<true>(interleaved, plain, group, row_bytes, K, 0, kRows8);
}

void deinterleave_group(QuantType interleaved, const uint8_t* group, uint8_t* plain, int64_t row_bytes, int64_t K,
                        int r0, int r1) {
  convert<false>(interleaved, group, plain, row_bytes, K, r0, r1);
}

}  // namespace cpu

QuantType interleaved_type(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0: return QuantType::kQ4_0x8;
    case QuantType::kQ8_0: return QuantType::kQ8_0x8;
    case QuantType::kQ5_0: return QuantType::kQ5_0x8;
    case QuantType::kQ5_1: return QuantType::kQ5_1x8;
    case QuantType::kQ4_Z: return QuantType::kQ4_Zx8;
    case QuantType::kQ4_K: return QuantType::kQ4_Kx8;
    case QuantType::kQ5_K: return QuantType::kQ5_Kx8;
    case QuantType::kQ6_K: return QuantType::kQ6_Kx8;
    default: return type;
  }
}

QuantType plain_type(QuantType type) {
  switch (type) {
    case QuantType::kQ4_0x8: return QuantType::kQ4_0;
    case QuantType::kQ8_0x8: return QuantType::kQ8_0;
    case QuantType::kQ5_0x8: return QuantType::kQ5_0;
    case QuantType::kQ5_1x8: return QuantType::kQ5_1;
    case QuantType::kQ4_Zx8: return QuantType::kQ4_Z;
    case QuantType::kQ4_Kx8: return QuantType::kQ4_K;
    case QuantType::kQ5_Kx8: return QuantType::kQ5_K;
    case QuantType::kQ6_Kx8: return QuantType::kQ6_K;
    default: return type;
  }
}

namespace {

void check_rows(const void* src, const void* dst, int64_t rows) {
  if (rows < 0 || rows % kInterleaveRows != 0)
    throw std::invalid_argument("rows: must be a multiple of " + std::to_string(kInterleaveRows) + ", got " +
                                std::to_string(rows));
  if (rows > 0 && (src == nullptr || dst == nullptr)) throw std::invalid_argument("src/dst: must not be null");
}

}  // namespace

void interleave_rows(QuantType type, const void* src, void* dst, int64_t rows, int64_t K) {
  const QuantType x8 = interleaved_type(type);
  if (x8 == type) throw std::invalid_argument(std::string("type: ") + quant_format(type).name + " has no interleaved layout");
  check_rows(src, dst, rows);
  const int64_t row_bytes = quant_row_bytes(type, K), group_bytes = kInterleaveRows * quant_row_bytes(x8, K);
  for (int64_t g = 0; g < rows / kInterleaveRows; ++g)
    cpu::interleave_group(x8, static_cast<const uint8_t*>(src) + g * kInterleaveRows * row_bytes, row_bytes,
                          static_cast<uint8_t*>(dst) + g * group_bytes, K);
}

void deinterleave_rows(QuantType interleaved, const void* src, void* dst, int64_t rows, int64_t K) {
  const QuantType plain = plain_type(interleaved);
  if (plain == interleaved)
    throw std::invalid_argument(std::string("interleaved: ") + quant_format(plain).name + " is not an interleaved layout");
  check_rows(src, dst, rows);
  const int64_t row_bytes = quant_row_bytes(plain, K), group_bytes = kInterleaveRows * quant_row_bytes(interleaved, K);
  for (int64_t g = 0; g < rows / kInterleaveRows; ++g)
    cpu::deinterleave_group(interleaved, static_cast<const uint8_t*>(src) + g * group_bytes,
                            static_cast<uint8_t*>(dst) + g * kInterleaveRows * row_bytes, row_bytes, K);
}

}  // namespace pyengine::kernels
