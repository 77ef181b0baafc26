// The quantized block layouts (llama.cpp's, see pyengine/cpu_quant.h) and the 8-bit activation
// blocks the quantized linear kernels multiply them with. Included by baseline and by per-level
// translation units: everything here is a type, a constant or `static inline`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "dtype_convert.h"

namespace pyengine::kernels::cpu {

constexpr int kQK = 32;    // weights per Q8_0 / Q4_0 block
constexpr int kQKK = 256;  // weights per K-quant super-block

struct BlockQ8_0 {
  uint16_t d;  // fp16
  int8_t qs[kQK];
};
struct BlockQ4_0 {
  uint16_t d;  // fp16
  uint8_t qs[kQK / 2];
};
struct BlockQ5_0 {
  uint16_t d;     // fp16
  uint8_t qh[4];  // the fifth bits, bit j = weight j (little-endian)
  uint8_t qs[kQK / 2];
};
struct BlockQ5_1 {
  uint16_t d;     // fp16
  uint16_t m;     // fp16, the value of level 0
  uint8_t qh[4];  // the fifth bits, as Q5_0's
  uint8_t qs[kQK / 2];
};
struct BlockQ4_Z {
  uint16_t d;  // fp16
  uint8_t z;   // zero point, 0..15
  uint8_t pad;
  uint8_t qs[kQK / 2];
};
struct BlockQ4_K {
  uint16_t d;     // fp16, the scale of the sub-block scales
  uint16_t dmin;  // fp16, the scale of the sub-block mins
  uint8_t scales[12];
  uint8_t qs[kQKK / 2];
};
struct BlockQ5_K {
  uint16_t d;     // fp16, the scale of the sub-block scales
  uint16_t dmin;  // fp16, the scale of the sub-block mins
  uint8_t scales[12];  // as Q4_K's
  uint8_t qh[kQKK / 8];  // fifth bits: bit 2c (2c + 1) of qh[l] for the low (high) nibble of qs[32c + l]
  uint8_t qs[kQKK / 2];
};
struct BlockQ6_K {
  uint8_t ql[kQKK / 2];
  uint8_t qh[kQKK / 4];
  int8_t scales[kQKK / 16];
  uint16_t d;  // fp16
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24,
              "llama.cpp block sizes");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210,
              "llama.cpp block sizes");
static_assert(sizeof(BlockQ4_Z) == 20, "pyengine's Q4_Z");

// The interleaved layouts (8 rows side by side; pyengine/cpu_quant.h describes them): one group
// block each.
constexpr int kRows8 = 8;
struct BlockQ8_0x8 {
  uint16_t d[kRows8];  // fp16
  int8_t qs[kRows8 * kQK];
};
struct BlockQ4_0x8 {
  uint16_t d[kRows8];  // fp16
  uint8_t qs[kRows8 * kQK / 2];
};
struct BlockQ5_0x8 {
  uint16_t d[kRows8];  // fp16
  uint8_t qh[kRows8 * kQK / 8];  // fifth bits (pyengine/cpu_quant.h)
  uint8_t qs[kRows8 * kQK / 2];  // the low 4 bits, as Q4_0x8's
};
struct BlockQ5_1x8 {
  uint16_t d[kRows8];  // fp16
  uint16_t m[kRows8];  // fp16
  uint8_t qh[kRows8 * kQK / 8];
  uint8_t qs[kRows8 * kQK / 2];
};
struct BlockQ4_Zx8 {
  uint16_t d[kRows8];  // fp16
  uint8_t z[kRows8];   // zero points, 0..15
  uint8_t qs[kRows8 * kQK / 2];
};
struct BlockQ4_Kx8 {
  uint16_t d[kRows8];     // fp16
  uint16_t dmin[kRows8];  // fp16
  uint8_t scales[8 * kRows8];  // [sub-block][row]
  uint8_t mins[8 * kRows8];    // [sub-block pair][row][2]
  uint8_t qs[kRows8 * kQKK / 2];
};
struct BlockQ5_Kx8 {
  BlockQ4_Kx8 low;                 // the levels' low 4 bits, and the scales, as Q4_Kx8's
  uint8_t qh[8][kRows8 * kQK / 8];  // per sub-block: the fifth bits (pyengine/cpu_quant.h)
};
struct BlockQ6_Kx8 {
  uint16_t d[kRows8];            // fp16
  int8_t scales[16 * kRows8];    // [sub-block pair][row][2]
  uint8_t q[16][96];             // per sub-block of 16: ql chunks A, B, qh chunk H
};
static_assert(sizeof(BlockQ4_0x8) == 8 * sizeof(BlockQ4_0) && sizeof(BlockQ8_0x8) == 8 * sizeof(BlockQ8_0) &&
                  sizeof(BlockQ6_Kx8) == 8 * sizeof(BlockQ6_K),
              "interleaved layouts of Q4_0, Q8_0 and Q6_K take the same bytes");
static_assert(sizeof(BlockQ5_0x8) == 8 * sizeof(BlockQ5_0) && sizeof(BlockQ5_1x8) == 8 * sizeof(BlockQ5_1),
              "interleaved layouts of Q5_0 and Q5_1 take the same bytes");
static_assert(sizeof(BlockQ4_Kx8) == 1184, "Q4_Kx8: 8 x 148 bytes");
static_assert(sizeof(BlockQ5_Kx8) == 1440, "Q5_Kx8: 8 x 180 bytes");
static_assert(sizeof(BlockQ4_Zx8) == 152, "Q4_Zx8: 8 x 19 bytes");

// Activations quantized for blocks of 32 weights: x ~= d * qs; s8 = 8 * d * sum(qs) (what Q4_0's
// level offset of 8 takes off a block's dot product; Q5_0's offset of 16 takes 2 * s8; Q5_1's
// m adds m * s8 / 8).
struct ActQ8_32 {
  float d;
  float s8;
  int8_t qs[kQK];
};
// Activations quantized for super-blocks of 256 weights, with the sums of each 16 values.
struct ActQ8_256 {
  float d;
  int16_t bsums[kQKK / 16];
  int8_t qs[kQKK];
};

// Round to nearest, ties to even, for |f| < 2^22 (llama.cpp's nearest_int, whose results the
// reference quantizers must reproduce).
static inline int nearest_int(float f) {
  const float v = f + 12582912.0f;  // 1.5 * 2^23: the integer lands in the low mantissa bits
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return static_cast<int>(u & 0x007fffffu) - 0x00400000;
}

// Q4_K's 6-bit scale and min of sub-block j (0..7) from its 12 packed bytes.
static inline void q4k_scale_min(int j, const uint8_t* s, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// The inverse: 8 scales and 8 mins (6 bits each) into Q4_K's 12 packed bytes.
static inline void q4k_pack_scale_min(const uint8_t* sc, const uint8_t* m, uint8_t* s) {
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0f) | ((m[j + 4] & 0x0f) << 4));
  }
}

// The level of weight l (0..31) of sub-block j of a Q4_K / Q5_K super-block whose 32 bytes of
// nibbles for sub-blocks j & ~1, j | 1 are at q (the low nibbles for even j, `high` = j odd),
// with Q5_K's fifth bit (bit j of qh[l]).
static inline int k_level(const BlockQ4_K&, const uint8_t* q, int l, int, bool high) {
  return high ? q[l] >> 4 : q[l] & 0x0f;
}
static inline int k_level(const BlockQ5_K& b, const uint8_t* q, int l, int j, bool high) {
  return (high ? q[l] >> 4 : q[l] & 0x0f) | (((b.qh[l] >> j) & 1) << 4);
}

// A Q4_K / Q5_K super-block's 256 levels into L (position 64c + l (+ 32) in the low (high)
// nibble of qs[32c + l]), and L packed back (Q5_K: the fifth bits of qh set from bit 4 of L).
template <typename B>
static inline void k_levels(const B& b, uint8_t* L) {
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      L[64 * c + l] = static_cast<uint8_t>(k_level(b, b.qs + 32 * c, l, 2 * c, false));
      L[64 * c + l + 32] = static_cast<uint8_t>(k_level(b, b.qs + 32 * c, l, 2 * c + 1, true));
    }
}
template <typename B>
static inline void k_set_levels(B& b, const uint8_t* L) {
  constexpr bool kFifthBits = std::is_same_v<B, BlockQ5_K>;
  if constexpr (kFifthBits) std::memset(b.qh, 0, sizeof(b.qh));
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      const int lo = L[64 * c + l], hi = L[64 * c + l + 32];
      b.qs[32 * c + l] = static_cast<uint8_t>((lo & 0x0f) | ((hi & 0x0f) << 4));
      if constexpr (kFifthBits)
        b.qh[l] = static_cast<uint8_t>(b.qh[l] | ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
    }
}

// A Q5_0 / Q5_1 block's 32 levels (0..31) into L: weight i's low 4 bits as Q4_0's nibbles (low
// nibble of qs[i], high nibble of qs[i - 16]), its fifth bit in bit i of the little-endian
// uint32 at qh; and levels packed back (bit 4 of each level into qh).
static inline void q5_levels(const uint8_t* qh4, const uint8_t* qs, uint8_t* L) {
  const uint32_t qh = qh4[0] | (qh4[1] << 8) | (qh4[2] << 16) | (static_cast<uint32_t>(qh4[3]) << 24);
  for (int i = 0; i < kQK / 2; ++i) {
    L[i] = static_cast<uint8_t>((qs[i] & 0x0f) | (((qh >> i) & 1) << 4));
    L[i + kQK / 2] = static_cast<uint8_t>((qs[i] >> 4) | (((qh >> (i + kQK / 2)) & 1) << 4));
  }
}
static inline void q5_set_levels(const uint8_t* L, uint8_t* qh4, uint8_t* qs) {
  uint32_t qh = 0;
  for (int i = 0; i < kQK; ++i) qh |= static_cast<uint32_t>((L[i] >> 4) & 1) << i;
  for (int i = 0; i < 4; ++i) qh4[i] = static_cast<uint8_t>(qh >> (8 * i));
  for (int i = 0; i < kQK / 2; ++i) qs[i] = static_cast<uint8_t>((L[i] & 0x0f) | ((L[i + kQK / 2] & 0x0f) << 4));
}

// Quantizes n values (a multiple of 16) into `blocks` ActQ8_32 (n % 32 == 0) or ActQ8_256
// (n % 256 == 0): d = max|x| / 127, q = nearest(x / d).
static inline void quantize_act_32(const float* x, ActQ8_32* out, int64_t n) {
  for (int64_t b = 0; b < n / kQK; ++b) {
    const float* v = x + b * kQK;
    float amax = 0.0f;
    for (int i = 0; i < kQK; ++i) amax = std::max(amax, v[i] < 0 ? -v[i] : v[i]);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out[b].d = d;
    int sum = 0;
    for (int i = 0; i < kQK; ++i) {
      const int q = nearest_int(v[i] * id);
      out[b].qs[i] = static_cast<int8_t>(q);
      sum += q;
    }
    out[b].s8 = static_cast<float>(8 * sum) * d;
  }
}

static inline void quantize_act_256(const float* x, ActQ8_256* out, int64_t n) {
  for (int64_t b = 0; b < n / kQKK; ++b) {
    const float* v = x + b * kQKK;
    float amax = 0.0f;
    for (int i = 0; i < kQKK; ++i) amax = std::max(amax, v[i] < 0 ? -v[i] : v[i]);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    out[b].d = d;
    for (int g = 0; g < kQKK / 16; ++g) {
      int sum = 0;
      for (int i = g * 16; i < g * 16 + 16; ++i) {
        const int q = nearest_int(v[i] * id);
        out[b].qs[i] = static_cast<int8_t>(q);
        sum += q;
      }
      out[b].bsums[g] = static_cast<int16_t>(sum);
    }
  }
}

}  // namespace pyengine::kernels::cpu
