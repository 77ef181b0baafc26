// quant_format, quantize_rows, dequantize_rows, dequantize_gather: see pyengine/cpu_quant.h.
//
// The quantizers follow llama.cpp's reference (no importance matrix) algorithms step for step,
// including its rounding (nearest_int: ties to even; Q8_0 uses roundf: ties away from zero),
// so that a model quantized here matches one quantized by llama-quantize. Compiled with
// -ffp-contract=off: every multiply and add rounds on its own, on every CPU.
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "dtype_convert.h"
#include "pyengine/cpu_quant.h"
#include "quant_blocks.h"
#include "quant_interleave.h"

namespace pyengine::kernels {

namespace {

using namespace cpu;

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// The value of largest magnitude among x[0..n), with its sign (the first such, 0 if all are 0).
float signed_absmax(const float* x, int n) {
  float amax = 0.0f, max = 0.0f;
  for (int i = 0; i < n; ++i)
    if (amax < std::fabs(x[i])) amax = std::fabs(x[i]), max = x[i];
  return max;
}

// ---- Q8_0, Q4_0, Q5_0, Q5_1 ----

void quantize_q8_0(const float* x, BlockQ8_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    float amax = 0.0f;
    for (int i = 0; i < kQK; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    for (int i = 0; i < kQK; ++i) y[b].qs[i] = static_cast<int8_t>(std::roundf(x[i] * id));
  }
}

void quantize_q4_0(const float* x, BlockQ4_0* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    // the value of largest magnitude, with its sign, maps to -8 exactly
    const float d = signed_absmax(x, kQK) / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    for (int j = 0; j < kQK / 2; ++j) {
      // truncation toward zero of x * id + 8.5, i.e. rounding to nearest with ties up
      const int lo = std::min(15, static_cast<int>(static_cast<int8_t>(x[j] * id + 8.5f)));
      const int hi = std::min(15, static_cast<int>(static_cast<int8_t>(x[kQK / 2 + j] * id + 8.5f)));
      y[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

void quantize_q5_0(const float* x, BlockQ5_0* y, int64_t nb) {
  uint8_t L[kQK];
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    const float d = signed_absmax(x, kQK) / -16.0f;  // (Q4_0's choice, 32 levels)
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    // truncation toward zero of x * id + 16.5, i.e. rounding to nearest with ties up
    for (int i = 0; i < kQK; ++i)
      L[i] = static_cast<uint8_t>(std::min(31, static_cast<int>(static_cast<int8_t>(x[i] * id + 16.5f))));
    q5_set_levels(L, y[b].qh, y[b].qs);
  }
}

void quantize_q5_1(const float* x, BlockQ5_1* y, int64_t nb) {
  uint8_t L[kQK];
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    float lo = x[0], hi = x[0];  // (not widened to 0: level 0 is the block's min)
    for (int i = 1; i < kQK; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
    const float d = (hi - lo) / 31.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    y[b].d = f32_to_fp16(d);
    y[b].m = f32_to_fp16(lo);
    // truncation of (x - min) * id + 0.5 to a byte: rounding to nearest with ties up
    for (int i = 0; i < kQK; ++i) L[i] = static_cast<uint8_t>((x[i] - lo) * id + 0.5f);
    q5_set_levels(L, y[b].qh, y[b].qs);
  }
}

// Asymmetric 4-bit grid per block, as AWQ / GPTQ quantize without calibration.
void quantize_q4_z(const float* x, BlockQ4_Z* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, x += kQK) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < kQK; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
    lo = std::min(lo, 0.0f);
    hi = std::max(hi, 0.0f);
    const uint16_t dh = f32_to_fp16((hi - lo) / 15.0f);
    const float d = fp16_to_f32(dh);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const int z = std::max(0, std::min(15, nearest_int(-lo * id)));
    y[b].d = dh;
    y[b].z = static_cast<uint8_t>(z);
    y[b].pad = 0;
    for (int j = 0; j < kQK / 2; ++j) {
      const int q0 = std::max(0, std::min(15, nearest_int(x[j] * id) + z));
      const int q1 = std::max(0, std::min(15, nearest_int(x[j + kQK / 2] * id) + z));
      y[b].qs[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
  }
}

// ---- Q4_K, Q5_K: per sub-block of 32, an asymmetric grid (scale, min) chosen by a search ----

// Quantizes n values to levels 0..nmax with x ~= scale * l - min_out, minimizing the squared
// error weighted by w: the min-max grid first, then nstep + 1 rescaled grids (each spanning from
// the best min so far to the max) refit by weighted least squares. Returns scale; L gets the
// levels.
float fit_scale_min(int n, int nmax, const float* x, const float* w, uint8_t* L, float* min_out,
                    float rmin, float rdelta, int nstep) {
  float lo = x[0], hi = x[0];
  float sum_w = w[0], sum_x = w[0] * x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (lo > 0) lo = 0;
  if (hi == lo) {
    std::memset(L, 0, static_cast<size_t>(n));
    *min_out = -lo;
    return 0.0f;
  }
  float iscale = nmax / (hi - lo);
  float scale = 1 / iscale;
  float min = lo;
  float best = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - lo))));
    L[i] = static_cast<uint8_t>(l);
    const float diff = scale * l + lo - x[i];
    best += w[i] * (diff * diff);
  }
  uint8_t aux[kQKK];
  // each candidate grid starts from the best min found so far (as llama.cpp's search does)
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * is + nmax) / (hi - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::max(0, std::min(nmax, nearest_int(iscale * (x[i] - min))));
      aux[i] = static_cast<uint8_t>(l);
      sum_l += w[i] * l;
      sum_l2 += w[i] * l * l;
      sum_xl += w[i] * l * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D <= 0) continue;
    float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
    float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
    if (this_min > 0) {
      this_min = 0;
      this_scale = sum_xl / sum_l2;
    }
    float err = 0;
    for (int i = 0; i < n; ++i) {
      const float diff = this_scale * aux[i] + this_min - x[i];
      err += w[i] * (diff * diff);
    }
    if (err < best) {
      std::memcpy(L, aux, static_cast<size_t>(n));
      best = err;
      scale = this_scale;
      min = this_min;
    }
  }
  *min_out = -min;
  return scale;
}

// Q4_K and Q5_K: per sub-block of 32 an asymmetric grid of levels 0..nmax (15, 31) whose scale
// and min fit_scale_min searches (llama.cpp's parameters for each), the 8 scales and mins
// rounded to 6 bits against the block's largest, then the levels again against the rounded
// values. Fills d, dmin and the packed scales; returns the levels in L.
template <typename Block>
void quantize_k_scales_mins(const float* x, Block& out, int nmax, float rmin, int nstep, uint8_t* L) {
  float w[32], scales[8], mins[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* v = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += v[l] * v[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = av_x + std::fabs(v[l]);
    scales[j] = fit_scale_min(32, nmax, v, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    ls[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_scale * scales[j])));
    lm[j] = std::min<uint8_t>(63, static_cast<uint8_t>(nearest_int(inv_min * mins[j])));
  }
  q4k_pack_scale_min(ls, lm, out.scales);
  out.d = f32_to_fp16(max_scale / 63.0f);
  out.dmin = f32_to_fp16(max_min / 63.0f);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    q4k_scale_min(j, out.scales, sc, m);
    const float d = fp16_to_f32(out.d) * sc;
    if (d == 0.0f) continue;
    const float dm = fp16_to_f32(out.dmin) * m;
    for (int i = 0; i < 32; ++i)
      L[32 * j + i] = static_cast<uint8_t>(std::max(0, std::min(nmax, nearest_int((x[32 * j + i] + dm) / d))));
  }
}

// Q4_K (levels 0..15, llama.cpp's search from rmin -1 in 20 steps) or Q5_K (0..31, from -0.5 in
// 15), its levels packed as nibbles (and Q5_K's fifth bits).
template <typename Block>
void quantize_k_min(const float* x, Block* y, int64_t nb) {
  constexpr bool kFifthBits = std::is_same_v<Block, BlockQ5_K>;
  uint8_t L[kQKK];
  for (int64_t b = 0; b < nb; ++b, x += kQKK) {
    Block& out = y[b];
    std::memset(&out, 0, sizeof(out));
    quantize_k_scales_mins(x, out, kFifthBits ? 31 : 15, kFifthBits ? -0.5f : -1.0f, kFifthBits ? 15 : 20, L);
    k_set_levels(out, L);
  }
}

// ---- Q6_K: per sub-block of 16, a symmetric 6-bit grid whose scale is searched ----

constexpr float kGroupMaxEps = 1e-15f;

// Levels -nmax..nmax-1 (stored + nmax in L) for n values, weights x^2; tries 19 grid scales
// around nmax / max|x| and keeps the least-squares best. Returns the scale.
float fit_scale_symmetric(int n, int nmax, const float* x, int8_t* L) {
  const float max = signed_absmax(x, n);
  if (std::fabs(max) < kGroupMaxEps) {
    std::memset(L, 0, static_cast<size_t>(n));
    return 0.0f;
  }
  auto level = [nmax](float iscale, float v) {
    return std::max(-nmax, std::min(nmax - 1, nearest_int(iscale * v)));
  };
  float iscale = -nmax / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    const int l = level(iscale, x[i]);
    L[i] = static_cast<int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * l;
    suml2 += w * l * l;
  }
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(nmax + 0.1f * is) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = level(iscale, x[i]);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * l;
      suml2 += w * l * l;
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) L[i] = static_cast<int8_t>(nmax + level(iscale, x[i]));
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

void quantize_q6_k(const float* x, BlockQ6_K* y, int64_t nb) {
  int8_t L[kQKK];
  float scales[16];
  for (int64_t b = 0; b < nb; ++b, x += kQKK) {
    BlockQ6_K& out = y[b];
    std::memset(&out, 0, sizeof(out));
    float max_scale = 0, max_abs_scale = 0;
    for (int j = 0; j < 16; ++j) {
      scales[j] = fit_scale_symmetric(16, 32, x + 16 * j, L + 16 * j);
      if (std::fabs(scales[j]) > max_abs_scale) max_abs_scale = std::fabs(scales[j]), max_scale = scales[j];
    }
    if (max_abs_scale < kGroupMaxEps) continue;  // all zero
    const float iscale = -128.0f / max_scale;
    out.d = f32_to_fp16(1 / iscale);
    for (int j = 0; j < 16; ++j) out.scales[j] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[j])));
    for (int j = 0; j < 16; ++j) {
      const float d = fp16_to_f32(out.d) * out.scales[j];
      if (d == 0.0f) continue;
      for (int i = 0; i < 16; ++i)
        L[16 * j + i] = static_cast<int8_t>(std::max(-32, std::min(31, nearest_int(x[16 * j + i] / d))) + 32);
    }
    for (int j = 0; j < kQKK; j += 128) {
      uint8_t* ql = out.ql + j / 2;
      uint8_t* qh = out.qh + j / 4;
      for (int l = 0; l < 32; ++l) {
        const int q1 = L[j + l], q2 = L[j + l + 32], q3 = L[j + l + 64], q4 = L[j + l + 96];
        ql[l] = static_cast<uint8_t>((q1 & 0xf) | ((q3 & 0xf) << 4));
        ql[l + 32] = static_cast<uint8_t>((q2 & 0xf) | ((q4 & 0xf) << 4));
        qh[l] = static_cast<uint8_t>((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
      }
    }
  }
}

// ---- dequantization ----

void dequantize_q8_0(const BlockQ8_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = fp16_to_f32(x[b].d);
    for (int i = 0; i < kQK; ++i) y[i] = d * x[b].qs[i];
  }
}

void dequantize_q4_0(const BlockQ4_0* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = fp16_to_f32(x[b].d);
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * ((x[b].qs[j] & 0x0f) - 8);
      y[j + kQK / 2] = d * ((x[b].qs[j] >> 4) - 8);
    }
  }
}

void dequantize_q5_0(const BlockQ5_0* x, float* y, int64_t nb) {
  uint8_t L[kQK];
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = fp16_to_f32(x[b].d);
    q5_levels(x[b].qh, x[b].qs, L);
    for (int i = 0; i < kQK; ++i) y[i] = d * (L[i] - 16);
  }
}

void dequantize_q5_1(const BlockQ5_1* x, float* y, int64_t nb) {
  uint8_t L[kQK];
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = fp16_to_f32(x[b].d), m = fp16_to_f32(x[b].m);
    q5_levels(x[b].qh, x[b].qs, L);
    for (int i = 0; i < kQK; ++i) y[i] = d * L[i] + m;
  }
}

void dequantize_q4_z(const BlockQ4_Z* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b, y += kQK) {
    const float d = fp16_to_f32(x[b].d);
    const int z = x[b].z;
    for (int j = 0; j < kQK / 2; ++j) {
      y[j] = d * ((x[b].qs[j] & 0x0f) - z);
      y[j + kQK / 2] = d * ((x[b].qs[j] >> 4) - z);
    }
  }
}

// Q4_K, Q5_K (with the fifth bits of its weights)
template <typename Block>
void dequantize_k_min(const Block* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = fp16_to_f32(x[b].d), dmin = fp16_to_f32(x[b].dmin);
    const uint8_t* q = x[b].qs;
    for (int j = 0; j < 8; j += 2, q += 32) {
      uint8_t sc0, m0, sc1, m1;
      q4k_scale_min(j, x[b].scales, sc0, m0);
      q4k_scale_min(j + 1, x[b].scales, sc1, m1);
      const float d0 = d * sc0, min0 = dmin * m0, d1 = d * sc1, min1 = dmin * m1;
      for (int l = 0; l < 32; ++l) *y++ = d0 * k_level(x[b], q, l, j, false) - min0;
      for (int l = 0; l < 32; ++l) *y++ = d1 * k_level(x[b], q, l, j + 1, true) - min1;
    }
  }
}

void dequantize_q6_k(const BlockQ6_K* x, float* y, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    const float d = fp16_to_f32(x[b].d);
    for (int half = 0; half < 2; ++half, y += 128) {
      const uint8_t* ql = x[b].ql + 64 * half;
      const uint8_t* qh = x[b].qh + 32 * half;
      const int8_t* sc = x[b].scales + 8 * half;
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * sc[is] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
    }
  }
}

// One row: nb blocks at src into K floats at dst.
void dequantize_row(QuantType type, const uint8_t* src, float* dst, int64_t nb) {
  switch (type) {
    case QuantType::kQ8_0: return dequantize_q8_0(reinterpret_cast<const BlockQ8_0*>(src), dst, nb);
    case QuantType::kQ4_0: return dequantize_q4_0(reinterpret_cast<const BlockQ4_0*>(src), dst, nb);
    case QuantType::kQ5_0: return dequantize_q5_0(reinterpret_cast<const BlockQ5_0*>(src), dst, nb);
    case QuantType::kQ5_1: return dequantize_q5_1(reinterpret_cast<const BlockQ5_1*>(src), dst, nb);
    case QuantType::kQ4_Z: return dequantize_q4_z(reinterpret_cast<const BlockQ4_Z*>(src), dst, nb);
    case QuantType::kQ4_K: return dequantize_k_min(reinterpret_cast<const BlockQ4_K*>(src), dst, nb);
    case QuantType::kQ5_K: return dequantize_k_min(reinterpret_cast<const BlockQ5_K*>(src), dst, nb);
    case QuantType::kQ6_K: return dequantize_q6_k(reinterpret_cast<const BlockQ6_K*>(src), dst, nb);
    default: return;  // interleaved layouts: dequantize_group
  }
}

// Rows [r0, r0 + count) of one interleaved group (at `group`) into count x K floats, through
// `rows` (scratch, resized to the group's 8 plain rows).
void dequantize_group(QuantType interleaved, const uint8_t* group, int r0, int count, float* dst, int64_t K,
                      std::vector<uint8_t>& rows) {
  const QuantType plain = plain_type(interleaved);
  const int64_t row_bytes = quant_row_bytes(plain, K);
  rows.resize(static_cast<size_t>(kRows8 * row_bytes));
  deinterleave_group(interleaved, group, rows.data(), row_bytes, K, r0, r0 + count);
  for (int r = 0; r < count; ++r)
    dequantize_row(plain, rows.data() + (r0 + r) * row_bytes, dst + r * K, K / quant_format(plain).block_elems);
}

}  // namespace

QuantFormat quant_format(QuantType type) {
  switch (type) {
    case QuantType::kQ8_0: return {"q8_0", kQK, static_cast<int32_t>(sizeof(BlockQ8_0))};
    case QuantType::kQ4_0: return {"q4_0", kQK, static_cast<int32_t>(sizeof(BlockQ4_0))};
    case QuantType::kQ5_0: return {"q5_0", kQK, static_cast<int32_t>(sizeof(BlockQ5_0))};
    case QuantType::kQ5_1: return {"q5_1", kQK, static_cast<int32_t>(sizeof(BlockQ5_1))};
    case QuantType::kQ4_Z: return {"q4_z", kQK, static_cast<int32_t>(sizeof(BlockQ4_Z))};
    case QuantType::kQ4_K: return {"q4_k", kQKK, static_cast<int32_t>(sizeof(BlockQ4_K))};
    case QuantType::kQ5_K: return {"q5_k", kQKK, static_cast<int32_t>(sizeof(BlockQ5_K))};
    case QuantType::kQ6_K: return {"q6_k", kQKK, static_cast<int32_t>(sizeof(BlockQ6_K))};
    case QuantType::kQ4_0x8: return {"q4_0x8", kQK, static_cast<int32_t>(sizeof(BlockQ4_0x8) / kRows8)};
    case QuantType::kQ8_0x8: return {"q8_0x8", kQK, static_cast<int32_t>(sizeof(BlockQ8_0x8) / kRows8)};
    case QuantType::kQ5_0x8: return {"q5_0x8", kQK, static_cast<int32_t>(sizeof(BlockQ5_0x8) / kRows8)};
    case QuantType::kQ5_1x8: return {"q5_1x8", kQK, static_cast<int32_t>(sizeof(BlockQ5_1x8) / kRows8)};
    case QuantType::kQ4_Zx8: return {"q4_zx8", kQK, static_cast<int32_t>(sizeof(BlockQ4_Zx8) / kRows8)};
    case QuantType::kQ4_Kx8: return {"q4_kx8", kQKK, static_cast<int32_t>(sizeof(BlockQ4_Kx8) / kRows8)};
    case QuantType::kQ5_Kx8: return {"q5_kx8", kQKK, static_cast<int32_t>(sizeof(BlockQ5_Kx8) / kRows8)};
    case QuantType::kQ6_Kx8: return {"q6_kx8", kQKK, static_cast<int32_t>(sizeof(BlockQ6_Kx8) / kRows8)};
  }
  fail("type: unknown quantization type id " + std::to_string(static_cast<int32_t>(type)) +
       " (known: 2 = q4_0, 6 = q5_0, 7 = q5_1, 8 = q8_0, 12 = q4_k, 13 = q5_k, 14 = q6_k, 100 = q4_z; "
       "interleaved: 202 = q4_0x8, 206 = q5_0x8, 207 = q5_1x8, 208 = q8_0x8, 212 = q4_kx8, 213 = q5_kx8, "
       "214 = q6_kx8, 300 = q4_zx8)");
  return {};
}

int64_t quant_row_bytes(QuantType type, int64_t K) {
  const QuantFormat f = quant_format(type);
  if (K < 1 || K % f.block_elems != 0)
    fail("K: " + std::string(f.name) + " rows must hold a positive multiple of " +
         std::to_string(f.block_elems) + " weights, got " + std::to_string(K));
  return K / f.block_elems * f.block_bytes;
}

void quantize_rows(QuantType type, const float* src, void* dst, int64_t rows, int64_t K,
                   int32_t num_threads) {
  const int64_t row_bytes = quant_row_bytes(type, K);
  if (plain_type(type) != type)
    fail(std::string("type: ") + quant_format(type).name + " is an interleaved layout: quantize to " +
         quant_format(plain_type(type)).name + ", then interleave_rows");
  if (rows < 0) fail("rows: must be >= 0, got " + std::to_string(rows));
  if (rows > 0 && (src == nullptr || dst == nullptr)) fail("src/dst: must not be null");
  const int64_t nb = K / quant_format(type).block_elems;
  [[maybe_unused]] const int nt = cpu::resolve_threads(num_threads);  // read by the pragma only
PYENGINE_OMP(parallel for num_threads(nt) schedule(static) if (rows * K >= (1 << 16)))
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * K;
    uint8_t* y = static_cast<uint8_t*>(dst) + r * row_bytes;
    switch (type) {
      case QuantType::kQ8_0: quantize_q8_0(x, reinterpret_cast<BlockQ8_0*>(y), nb); break;
      case QuantType::kQ4_0: quantize_q4_0(x, reinterpret_cast<BlockQ4_0*>(y), nb); break;
      case QuantType::kQ5_0: quantize_q5_0(x, reinterpret_cast<BlockQ5_0*>(y), nb); break;
      case QuantType::kQ5_1: quantize_q5_1(x, reinterpret_cast<BlockQ5_1*>(y), nb); break;
      case QuantType::kQ4_Z: quantize_q4_z(x, reinterpret_cast<BlockQ4_Z*>(y), nb); break;
      case QuantType::kQ4_K: quantize_k_min(x, reinterpret_cast<BlockQ4_K*>(y), nb); break;
      case QuantType::kQ5_K: quantize_k_min(x, reinterpret_cast<BlockQ5_K*>(y), nb); break;
      case QuantType::kQ6_K: quantize_q6_k(x, reinterpret_cast<BlockQ6_K*>(y), nb); break;
      default: break;  // the interleaved layouts were rejected above
    }
  }
}

void dequantize_rows(QuantType type, const void* src, float* dst, int64_t rows, int64_t K) {
  const int64_t row_bytes = quant_row_bytes(type, K);
  if (rows < 0) fail("rows: must be >= 0, got " + std::to_string(rows));
  if (rows > 0 && (src == nullptr || dst == nullptr)) fail("src/dst: must not be null");
  const int64_t nb = K / quant_format(type).block_elems;
  if (plain_type(type) != type) {
    if (rows % kRows8 != 0) fail("rows: must be a multiple of 8 in an interleaved layout, got " + std::to_string(rows));
    std::vector<uint8_t> scratch;
    for (int64_t g = 0; g < rows / kRows8; ++g)
      dequantize_group(type, static_cast<const uint8_t*>(src) + g * kRows8 * row_bytes, 0, kRows8,
                       dst + g * kRows8 * K, K, scratch);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    dequantize_row(type, static_cast<const uint8_t*>(src) + r * row_bytes, dst + r * K, nb);
}

namespace {

// dequantize_gather for either id type: every id checked before anything is written.
template <typename Id>
void gather_rows(QuantType type, const void* src, int64_t num_rows, int64_t K, const Id* ids, int64_t count,
                 float* dst) {
  const int64_t row_bytes = quant_row_bytes(type, K);
  if (count < 0) fail("count: must be >= 0, got " + std::to_string(count));
  if (count > 0 && (src == nullptr || dst == nullptr || ids == nullptr))
    fail("src/ids/dst: must not be null");
  for (int64_t i = 0; i < count; ++i)
    if (ids[i] < 0 || ids[i] >= num_rows)
      fail("ids[" + std::to_string(i) + "]: " + std::to_string(ids[i]) + " is out of range [0, " +
           std::to_string(num_rows) + ")");
  const int64_t nb = K / quant_format(type).block_elems;
  if (plain_type(type) != type) {
    if (num_rows % kRows8 != 0)
      fail("num_rows: must be a multiple of 8 in an interleaved layout, got " + std::to_string(num_rows));
    // (kept: a decode step looks up a row or a few, and an allocation a call was most of that)
    thread_local std::vector<uint8_t> scratch;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t id = ids[i];
      dequantize_group(type, static_cast<const uint8_t*>(src) + id / kRows8 * kRows8 * row_bytes,
                       static_cast<int>(id % kRows8), 1, dst + i * K, K, scratch);
    }
    return;
  }
  for (int64_t i = 0; i < count; ++i)
    dequantize_row(type, static_cast<const uint8_t*>(src) + static_cast<int64_t>(ids[i]) * row_bytes, dst + i * K, nb);
}

}  // namespace

void dequantize_gather(QuantType type, const void* src, int64_t num_rows, int64_t K,
                       const int64_t* ids, int64_t count, float* dst) {
  gather_rows(type, src, num_rows, K, ids, count, dst);
}

void dequantize_gather(QuantType type, const void* src, int64_t num_rows, int64_t K,
                       const int32_t* ids, int64_t count, float* dst) {
  gather_rows(type, src, num_rows, K, ids, count, dst);
}

}  // namespace pyengine::kernels
