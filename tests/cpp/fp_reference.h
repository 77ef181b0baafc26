// Reference conversions for the CPU kernel tests, written independently of the library's bit
// tricks (csrc/kernels/cpu/dtype_convert.h): a 16-bit value is decoded with ldexp, and rounding
// to bf16 / fp16 picks the nearer of the two neighbouring representable values in double
// arithmetic (ties to the even bit pattern; overflow to infinity exactly when IEEE rounding
// would, by treating infinity as the next power of two past the largest finite value).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pyengine/kernels.h"

namespace fpref {

using pyengine::kernels::DType;

constexpr double kU32 = 0x1p-24;   // unit roundoff of fp32
constexpr double kUBf16 = 0x1p-8;  // of bf16 (8 significant bits)
constexpr double kUF16 = 0x1p-11;  // of fp16 (11 significant bits)
// Absolute error of rounding into fp16's subnormal range (half its smallest subnormal 2^-24).
constexpr double kF16SubnormalHalfStep = 0x1p-25;

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// ---- decoding ----

inline double bf16_value(uint16_t h) {
  const int e = (h >> 7) & 0xff;
  const int m = h & 0x7f;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0xff) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -133);  // subnormal: m * 2^(1 - 127 - 7)
  return sign * std::ldexp(128 + m, e - 134);
}

inline double f16_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (e == 0x1f) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

// ---- rounding to nearest, ties to even ----

// |v| rounded among the non-negative bit patterns 0..max_pattern of a format whose values
// increase with the pattern; `value(max_pattern + 1)` stands for infinity and is passed as
// `overflow_value` (the next power of two past the largest finite value).
template <typename ValueFn>
uint16_t round_magnitude(double a, uint16_t max_pattern, double overflow_value, ValueFn value) {
  // the largest pattern whose value is <= a (binary search; patterns are monotonic)
  uint32_t lo = 0, hi = max_pattern;
  if (a >= overflow_value) return static_cast<uint16_t>(max_pattern + 1);
  if (value(static_cast<uint16_t>(hi)) <= a) {
    lo = hi;
  } else {
    while (hi - lo > 1) {
      const uint32_t mid = (lo + hi) / 2;
      if (value(static_cast<uint16_t>(mid)) <= a) lo = mid; else hi = mid;
    }
  }
  const double below = value(static_cast<uint16_t>(lo));
  if (below == a) return static_cast<uint16_t>(lo);
  const double above = lo == max_pattern ? overflow_value : value(static_cast<uint16_t>(lo + 1));
  const double d_below = a - below, d_above = above - a;
  if (d_below < d_above) return static_cast<uint16_t>(lo);
  if (d_above < d_below) return static_cast<uint16_t>(lo + 1);
  return static_cast<uint16_t>((lo & 1u) == 0 ? lo : lo + 1);
}

// v (a double holding at most fp32 precision, or exact products/sums of such) to bf16 bits.
inline uint16_t to_bf16(double v) {
  if (std::isnan(v)) return 0x7fc0;
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const uint16_t mag = round_magnitude(std::fabs(v), 0x7f7f, 0x1p128, bf16_value);
  return static_cast<uint16_t>(sign | mag);
}

inline uint16_t to_f16(double v) {
  if (std::isnan(v)) return 0x7e00;
  const uint16_t sign = std::signbit(v) ? 0x8000 : 0;
  const uint16_t mag = round_magnitude(std::fabs(v), 0x7bff, 65536.0, f16_value);
  return static_cast<uint16_t>(sign | mag);
}

// ---- typed buffers: values of one DType as raw bytes ----

inline int size_of(DType d) { return d == DType::kFloat32 ? 4 : 2; }

inline const char* name_of(DType d) {
  switch (d) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    default: return "?";
  }
}

// Unit roundoff of storing into d.
inline double unit_roundoff(DType d) {
  return d == DType::kFloat32 ? kU32 : d == DType::kBFloat16 ? kUBf16 : kUF16;
}

struct Buffer {
  DType dtype;
  std::vector<uint8_t> bytes;
  Buffer(DType d, size_t n) : dtype(d), bytes(n * size_of(d)) {}
  size_t size() const { return bytes.size() / size_of(dtype); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  uint32_t bits(size_t i) const {
    if (dtype == DType::kFloat32) {
      uint32_t u;
      std::memcpy(&u, bytes.data() + 4 * i, 4);
      return u;
    }
    uint16_t h;
    std::memcpy(&h, bytes.data() + 2 * i, 2);
    return h;
  }
  void set_bits(size_t i, uint32_t b) {
    if (dtype == DType::kFloat32) {
      std::memcpy(bytes.data() + 4 * i, &b, 4);
    } else {
      const uint16_t h = static_cast<uint16_t>(b);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  double get(size_t i) const {
    const uint32_t b = bits(i);
    switch (dtype) {
      case DType::kFloat32: return bits_f32(b);
      case DType::kBFloat16: return bf16_value(static_cast<uint16_t>(b));
      default: return f16_value(static_cast<uint16_t>(b));
    }
  }
  // Stores v rounded to nearest, ties to even.
  void set(size_t i, double v) { set_bits(i, encode(dtype, v)); }
  static uint32_t encode(DType d, double v) {
    switch (d) {
      case DType::kFloat32: return f32_bits(static_cast<float>(v));
      case DType::kBFloat16: return to_bf16(v);
      default: return to_f16(v);
    }
  }
};

}  // namespace fpref
