// Scalar fp32 <-> bf16 / fp16 conversions, written so gcc can auto-vectorize loops over them
// (branch-free selects, no table lookups, no libgcc calls).
//
// All functions are `static inline`: this header is included both by translation units compiled
// for the baseline ISA and by ones compiled under `#pragma GCC target("avx512f,...")`. Internal
// linkage keeps an AVX-512 out-of-line copy from being shared (ODR-merged) with baseline code.
#pragma once

#include <cstdint>
#include <cstring>

namespace pyengine::kernels::cpu {

// Distinct 16-bit storage types so templates can dispatch on the element format.
struct bf16_t {
  uint16_t x;
};
struct fp16_t {
  uint16_t x;
};

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ---- bf16 ----

static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even (as torch does); NaN stays a (quiet) NaN.
static inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

// ---- fp16 (IEEE binary16) ----

static inline float fp16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h & 0x7fffu);
  // Normal numbers: move exponent/mantissa into place and rebias the exponent (15 -> 127).
  const uint32_t normal = (em << 13) + ((127u - 15u) << 23);
  // Inf / NaN: exponent all ones -> fp32 exponent all ones (mantissa kept, so NaN stays NaN).
  const uint32_t infnan = (em << 13) | 0x7f800000u;
  // Zero / subnormal: value = mantissa * 2^-24, exact in fp32.
  const float sub = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f;
  const uint32_t subbits = f32_bits(sub);
  const uint32_t mag = em >= 0x7c00u ? infnan : (em < 0x0400u ? subbits : normal);
  return bits_f32(sign | mag);
}

// Round to nearest, ties to even; overflow -> inf; NaN -> quiet NaN. Every case is computed and
// the right one selected, without branches, so that loops over it vectorize (a KV store converts
// a decode step's fp32 K/V rows to an fp16 cache with it).
static inline uint16_t f32_to_fp16(float f) {
  const uint32_t all = f32_bits(f);
  const uint32_t sign = (all >> 16) & 0x8000u;
  const uint32_t u = all & 0x7fffffffu;
  // inf, or a NaN made quiet with its top payload bits
  const uint32_t special = 0x7c00u | (u > 0x7f800000u ? (0x0200u | ((u >> 13) & 0x3ffu)) : 0u);
  // below 2^-14, an fp16 subnormal or zero: adding 0.5 puts the value's fp16-subnormal unit
  // (2^-24) at the fp32 ulp of 0.5, so the fp32 addition performs the round-to-nearest-even
  const uint32_t subnormal = f32_bits(bits_f32(u < 0x38800000u ? u : 0u) + 0.5f) - 0x3f000000u;
  const uint32_t normal = (u + (static_cast<uint32_t>(15 - 127) << 23) + 0x0fffu + ((u >> 13) & 1u)) >> 13;
  uint32_t out = u < 0x38800000u ? subnormal : normal;
  out = u >= 0x477ff000u ? 0x7c00u : out;  // >= 65520 rounds to inf
  out = u >= 0x7f800000u ? special : out;
  return static_cast<uint16_t>(sign | out);
}

// ---- generic load / store by storage type ----

static inline float to_f32(float v) { return v; }
static inline float to_f32(bf16_t v) { return bf16_to_f32(v.x); }
static inline float to_f32(fp16_t v) { return fp16_to_f32(v.x); }

static inline void store_f32(float* dst, float v) { *dst = v; }
static inline void store_f32(bf16_t* dst, float v) { dst->x = f32_to_bf16(v); }
static inline void store_f32(fp16_t* dst, float v) { dst->x = f32_to_fp16(v); }

}  // namespace pyengine::kernels::cpu
