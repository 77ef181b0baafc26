// The portable compute code of the quantized linear kernel: per block, the exact integer dot
// product of the weight levels with the 8-bit activations, scaled into an fp32 sum. Included by
// linear_quant_generic.cpp and by the builds of other architectures' levels, which are never
// dispatched to.
#ifndef PYENGINE_ISA_NS
#error "define PYENGINE_ISA_NS before including linear_quant_generic_impl.h"
#endif

#include <cstdint>
#include <vector>

#include "linear_quant_common.h"
#include "quant_interleave.h"

namespace pyengine::kernels::cpu::PYENGINE_ISA_NS {

namespace {

float dot_q8_0(const BlockQ8_0* w, const ActQ8_32* x, int32_t nb) {
  float acc = 0.0f;
  for (int32_t b = 0; b < nb; ++b) {
    int32_t s = 0;
    for (int i = 0; i < kQK; ++i) s += w[b].qs[i] * x[b].qs[i];
    acc += fp16_to_f32(w[b].d) * x[b].d * static_cast<float>(s);
  }
  return acc;
}

float dot_q4_0(const BlockQ4_0* w, const ActQ8_32* x, int32_t nb) {
  float acc = 0.0f;
  for (int32_t b = 0; b < nb; ++b) {
    int32_t s = 0;
    for (int j = 0; j < kQK / 2; ++j)
      s += ((w[b].qs[j] & 0x0f) - 8) * x[b].qs[j] + ((w[b].qs[j] >> 4) - 8) * x[b].qs[j + kQK / 2];
    acc += fp16_to_f32(w[b].d) * x[b].d * static_cast<float>(s);
  }
  return acc;
}

// A Q5_0 / Q5_1 block's levels (0..31) against 32 activations.
int32_t dot_5_bit_levels(const uint8_t* qh, const uint8_t* qs, const int8_t* xq) {
  uint8_t L[kQK];
  q5_levels(qh, qs, L);
  int32_t s = 0;
  for (int i = 0; i < kQK; ++i) s += L[i] * xq[i];
  return s;
}
// The sum of a block's 32 activations.
int32_t x_sum(const int8_t* xq) {
  int32_t s = 0;
  for (int i = 0; i < kQK; ++i) s += xq[i];
  return s;
}

float dot_q5_0(const BlockQ5_0* w, const ActQ8_32* x, int32_t nb) {
  float acc = 0.0f;
  for (int32_t b = 0; b < nb; ++b) {
    const int32_t s = dot_5_bit_levels(w[b].qh, w[b].qs, x[b].qs) - 16 * x_sum(x[b].qs);
    acc += fp16_to_f32(w[b].d) * x[b].d * static_cast<float>(s);
  }
  return acc;
}

// levels 0..31 against x, plus m times the block's sum of x (x.s8 / 8)
float dot_q5_1(const BlockQ5_1* w, const ActQ8_32* x, int32_t nb) {
  float acc = 0.0f;
  for (int32_t b = 0; b < nb; ++b) {
    const int32_t s = dot_5_bit_levels(w[b].qh, w[b].qs, x[b].qs);
    acc += fp16_to_f32(w[b].d) * x[b].d * static_cast<float>(s) + fp16_to_f32(w[b].m) * (0.125f * x[b].s8);
  }
  return acc;
}

float dot_q4_z(const BlockQ4_Z* w, const ActQ8_32* x, int32_t nb) {
  float acc = 0.0f;
  for (int32_t b = 0; b < nb; ++b) {
    const int z = w[b].z;
    int32_t s = 0;
    for (int j = 0; j < kQK / 2; ++j)
      s += ((w[b].qs[j] & 0x0f) - z) * x[b].qs[j] + ((w[b].qs[j] >> 4) - z) * x[b].qs[j + kQK / 2];
    acc += fp16_to_f32(w[b].d) * x[b].d * static_cast<float>(s);
  }
  return acc;
}

// Q4_K, Q5_K
template <typename Block>
float dot_k_min(const Block* w, const ActQ8_256* x, int32_t nb) {
  float acc = 0.0f;
  for (int32_t b = 0; b < nb; ++b) {
    int32_t s = 0, smin = 0;
    const uint8_t* q = w[b].qs;
    const int8_t* xq = x[b].qs;
    for (int j = 0; j < 8; j += 2, q += 32, xq += 64) {
      uint8_t sc0, m0, sc1, m1;
      q4k_scale_min(j, w[b].scales, sc0, m0);
      q4k_scale_min(j + 1, w[b].scales, sc1, m1);
      int32_t s0 = 0, s1 = 0;
      for (int l = 0; l < 32; ++l) {
        s0 += k_level(w[b], q, l, j, false) * xq[l];
        s1 += k_level(w[b], q, l, j + 1, true) * xq[l + 32];
      }
      s += sc0 * s0 + sc1 * s1;
      smin += m0 * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]) +
              m1 * (x[b].bsums[2 * j + 2] + x[b].bsums[2 * j + 3]);
    }
    acc += fp16_to_f32(w[b].d) * x[b].d * static_cast<float>(s) -
           fp16_to_f32(w[b].dmin) * x[b].d * static_cast<float>(smin);
  }
  return acc;
}

float dot_q6_k(const BlockQ6_K* w, const ActQ8_256* x, int32_t nb) {
  float acc = 0.0f;
  for (int32_t b = 0; b < nb; ++b) {
    int32_t s = 0;
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = w[b].ql + 64 * half;
      const uint8_t* qh = w[b].qh + 32 * half;
      const int8_t* sc = w[b].scales + 8 * half;
      const int8_t* xq = x[b].qs + 128 * half;
      int32_t part[8] = {};  // per sub-block of 16
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        part[is] += (((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32) * xq[l];
        part[is + 2] += (((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32) * xq[l + 32];
        part[is + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * xq[l + 64];
        part[is + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * xq[l + 96];
      }
      for (int j = 0; j < 8; ++j) s += sc[j] * part[j];
    }
    acc += fp16_to_f32(w[b].d) * x[b].d * static_cast<float>(s);
  }
  return acc;
}

float dot_row(const QuantLinearArgs& a, const uint8_t* w, const uint8_t* x) {
  switch (a.type) {
    case QuantType::kQ8_0:
      return dot_q8_0(reinterpret_cast<const BlockQ8_0*>(w), reinterpret_cast<const ActQ8_32*>(x), a.K / kQK);
    case QuantType::kQ4_0:
      return dot_q4_0(reinterpret_cast<const BlockQ4_0*>(w), reinterpret_cast<const ActQ8_32*>(x), a.K / kQK);
    case QuantType::kQ5_0:
      return dot_q5_0(reinterpret_cast<const BlockQ5_0*>(w), reinterpret_cast<const ActQ8_32*>(x), a.K / kQK);
    case QuantType::kQ5_1:
      return dot_q5_1(reinterpret_cast<const BlockQ5_1*>(w), reinterpret_cast<const ActQ8_32*>(x), a.K / kQK);
    case QuantType::kQ5_K:
      return dot_k_min(reinterpret_cast<const BlockQ5_K*>(w), reinterpret_cast<const ActQ8_256*>(x), a.K / kQKK);
    case QuantType::kQ4_Z:
      return dot_q4_z(reinterpret_cast<const BlockQ4_Z*>(w), reinterpret_cast<const ActQ8_32*>(x), a.K / kQK);
    case QuantType::kQ4_K:
      return dot_k_min(reinterpret_cast<const BlockQ4_K*>(w), reinterpret_cast<const ActQ8_256*>(x), a.K / kQKK);
    case QuantType::kQ6_K:
      return dot_q6_k(reinterpret_cast<const BlockQ6_K*>(w), reinterpret_cast<const ActQ8_256*>(x), a.K / kQKK);
    default: break;  // interleaved layouts: deinterleaved first
  }
  return 0.0f;
}

}  // namespace

void quantize_activations(const float* x, int64_t ldx, int32_t m0, int32_t m1, int32_t K, int32_t block,
                          uint8_t* xq, int64_t xrow_bytes) {
  quantize_activation_rows(x, ldx, m0, m1, K, block, xq, xrow_bytes, quantize_act_32, quantize_act_256);
}

void quant_linear_rows(const QuantLinearArgs& a, int32_t n0, int32_t n1) {
  const QuantType plain = plain_type(a.type);
  if (plain != a.type) {  // an interleaved layout: each group of 8 rows back to plain rows first
    QuantLinearArgs p = a;
    p.type = plain;
    p.wrow_bytes = quant_row_bytes(plain, a.K);
    std::vector<uint8_t> rows(static_cast<size_t>(kRows8 * p.wrow_bytes));
    for (int32_t g = n0 / kRows8; g < n1 / kRows8; ++g) {
      deinterleave_group(a.type, a.w + g * kRows8 * a.wrow_bytes, rows.data(), p.wrow_bytes, a.K);
      for (int r = 0; r < kRows8; ++r)
        for (int32_t m = 0; m < a.M; ++m)
          quant_linear_store(a, m, kRows8 * g + r, dot_row(p, rows.data() + r * p.wrow_bytes, a.xq + m * a.xrow_bytes));
    }
    return;
  }
  // each weight row once (it stays in cache across the rows of x)
  for (int32_t n = n0; n < n1; ++n) {
    const uint8_t* w = a.w + n * a.wrow_bytes;
    for (int32_t m = 0; m < a.M; ++m) quant_linear_store(a, m, n, dot_row(a, w, a.xq + m * a.xrow_bytes));
  }
}

}  // namespace pyengine::kernels::cpu::PYENGINE_ISA_NS
