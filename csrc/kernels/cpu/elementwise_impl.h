// Compute code of rms_norm, rotary_embedding, silu_mul and store_kv, compiled once per
// instruction-set level (elementwise_<level>.cpp; see isa_target.h). Plain loops over rows that
// gcc vectorizes for the level; the rows of a decode step are a few KB, so the win is one call
// instead of a dozen torch operations, not the arithmetic.
//
// Compiled with -ffp-contract=off: a fused multiply-add would round differently from torch's
// separate multiply and add (fp32 RoPE is bit-exact with torch only without it). So every
// level computes bit-identical results.
#ifndef PYENGINE_ISA_NS
#error "define PYENGINE_ISA_NS before including elementwise_impl.h"
#endif

#include "elementwise_deps.h"

namespace pyengine::kernels::cpu::PYENGINE_ISA_NS {

namespace {

// Calls f with a null pointer of the storage type of `dtype` (checked by the front end).
template <typename F>
void by_dtype(DType dtype, F&& f) {
  if (dtype == DType::kFloat32)
    f(static_cast<float*>(nullptr));
  else if (dtype == DType::kBFloat16)
    f(static_cast<bf16_t*>(nullptr));
  else
    f(static_cast<fp16_t*>(nullptr));
}

template <typename T>
inline float round_to(float v) {  // the value `v` takes once stored as T
  T t;
  store_f32(&t, v);
  return to_f32(t);
}

[[maybe_unused]] int threads_for(int32_t rows, int32_t num_threads) {
  if (rows < 4) return 1;
  return cpu::resolve_threads(num_threads);
}

// body(r) for each r in [0, rows), split statically over `threads` OpenMP threads, or on the
// calling thread alone when `threads` is 1: an OpenMP region of one thread still sets up and
// tears down a team (~0.2 us hot, more with the caches cold after a decode step's weight
// stream), and a one-token decode step calls these kernels 6 times a layer.
template <typename Body>
void for_rows(int32_t rows, [[maybe_unused]] int threads, Body&& body) {
  if (threads <= 1) {
    for (int32_t r = 0; r < rows; ++r) body(r);
    return;
  }
PYENGINE_OMP(parallel for num_threads(threads) schedule(static))
  for (int32_t r = 0; r < rows; ++r) body(r);
}

template <typename T>
void rms_norm_typed(const RmsNormArgs& a) {
  T* out = static_cast<T*>(a.out);
  const T* x = static_cast<const T*>(a.x);
  T* residual = static_cast<T*>(a.residual);
  const T* weight = static_cast<const T*>(a.weight);
  const int32_t hidden = a.hidden;
  for_rows(a.rows, threads_for(a.rows, a.num_threads), [&](int32_t r) {
    const T* xr = x + r * a.x_stride;
    const T* src = xr;
    if (residual != nullptr) {
      T* res = residual + r * a.residual_stride;
      for (int32_t i = 0; i < hidden; ++i) store_f32(res + i, to_f32(res[i]) + to_f32(xr[i]));
      src = res;
    }
    float lanes[16] = {};  // 16 partial sums: vectorizable without reassociating one long chain
    int32_t i = 0;
    for (; i + 16 <= hidden; i += 16)
      for (int32_t j = 0; j < 16; ++j) {
        const float v = to_f32(src[i + j]);
        lanes[j] += v * v;
      }
    for (int32_t j = 0; i < hidden; ++i, ++j) {
      const float v = to_f32(src[i]);
      lanes[j] += v * v;
    }
    float sum = 0.f;
    for (float l : lanes) sum += l;
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + a.eps);
    T* o = out + r * a.out_stride;
    for (i = 0; i < hidden; ++i)
      store_f32(o + i, to_f32(weight[i]) * round_to<T>(to_f32(src[i]) * inv));
  });
}

template <typename T>
void rotary_typed(const RotaryArgs& a) {
  T* x = static_cast<T*>(a.x);
  const T* cos = static_cast<const T*>(a.cos);
  const T* sin = static_cast<const T*>(a.sin);
  const int32_t head_dim = a.head_dim;
  const int32_t half = head_dim / 2;
  for_rows(a.tokens, threads_for(a.tokens, a.num_threads), [&](int32_t t) {
    const T* c = cos + static_cast<int64_t>(a.positions[t]) * head_dim;
    const T* s = sin + static_cast<int64_t>(a.positions[t]) * head_dim;
    for (int32_t h = 0; h < a.heads; ++h) {
      T* v = x + t * a.x_stride + static_cast<int64_t>(h) * head_dim;
      for (int32_t i = 0; i < half; ++i) {
        const float p = to_f32(v[i]), q = to_f32(v[i + half]);
        const float lo = round_to<T>(p * to_f32(c[i])) + round_to<T>(-q * to_f32(s[i]));
        const float hi = round_to<T>(q * to_f32(c[i + half])) + round_to<T>(p * to_f32(s[i + half]));
        store_f32(v + i, lo);
        store_f32(v + i + half, hi);
      }
    }
  });
}

// e^x for every float x, within about an ulp of the exact value, in branch-free arithmetic that
// gcc vectorizes (std::exp is a scalar libm call: 1,536 of them were most of a decode step's
// SiLU). x = n ln2 + r with |r| <= ln2 / 2 (n by the 1.5 * 2^23 rounding trick, read off the
// float's bits; ln2 split in two for an exact product), e^r by Cephes' degree-7 form
// 1 + r + r^2 p(r), then scaled by 2^n in two halves so that each factor is a normal float and
// the one rounding of the last product gives overflow to inf (x > ~88.72) and gradual underflow
// (x < ~-87.3) as a correctly scaled result would. x is clamped to [-104, 89] first (e^89 is
// inf, as for every x past ~88.72; e^-104 is 0), on integers: floats clamped by float selects
// are compiled into a branch, which stops the loop from vectorizing. A NaN x is clamped too
// (to one end): callers pass its NaN on through their other operands.
// A float's bits as an integer that orders as the floats do (negative floats' magnitude bits
// flipped); the same flip turns it back.
inline int32_t order_flip(int32_t b) { return b ^ ((b >> 31) & 0x7fffffff); }
inline int32_t float_order(float x) { return order_flip(static_cast<int32_t>(f32_bits(x))); }
inline float order_float(int32_t m) { return bits_f32(static_cast<uint32_t>(order_flip(m))); }
inline float exp_f(float x) {
  const int32_t lo = float_order(-104.0f), hi = float_order(89.0f);
  int32_t m = float_order(x);
  m = m < lo ? lo : m;
  m = m > hi ? hi : m;
  x = order_float(m);
  const float shifter = 12582912.0f;  // 1.5 * 2^23
  const float nf = x * 1.44269504088896341f + shifter;
  const int32_t n = static_cast<int32_t>(f32_bits(nf) - f32_bits(shifter));  // round(x / ln2), in [-150, 128]
  const float n_r = nf - shifter;
  const float r = (x - n_r * 0.693359375f) + n_r * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e_r = p * (r * r) + r + 1.0f;
  const int32_t n1 = n >> 1, n2 = n - n1;  // each in [-75, 64]: 2^n1, 2^n2 are normal floats
  const float s1 = bits_f32(static_cast<uint32_t>(n1 + 127) << 23);
  const float s2 = bits_f32(static_cast<uint32_t>(n2 + 127) << 23);
  return (e_r * s1) * s2;
}

template <typename T>
void silu_mul_typed(const SiluMulArgs& a) {
  const int32_t inter = a.inter;
  for_rows(a.rows, threads_for(a.rows, a.num_threads), [&](int32_t r) {
    const T* g = static_cast<const T*>(a.gate_up) + static_cast<int64_t>(r) * 2 * inter;
    const T* u = g + inter;
    T* o = static_cast<T*>(a.out) + static_cast<int64_t>(r) * inter;
    for (int32_t i = 0; i < inter; ++i) {
      const float gv = to_f32(g[i]);
      store_f32(o + i, round_to<T>(gv / (1.f + exp_f(-gv))) * to_f32(u[i]));
    }
  });
}

template <typename Src, typename Dst>
void convert_row(const Src* __restrict src, Dst* __restrict dst, int32_t n) {
  for (int32_t i = 0; i < n; ++i) store_f32(dst + i, to_f32(src[i]));
}

// Scatters this step's K/V rows into their cache slots: cache index (block, head, offset, 0).
template <typename Src, typename Dst>
void store_kv_typed(const StoreKvArgs& a) {
  const Src* k = static_cast<const Src*>(a.key);
  const Src* v = static_cast<const Src*>(a.value);
  Dst* kc = static_cast<Dst*>(a.k_cache);
  Dst* vc = static_cast<Dst*>(a.v_cache);
  const int32_t heads = a.num_kv_heads, head_dim = a.head_dim, tpb = a.tokens_per_block;
  const int64_t work = static_cast<int64_t>(a.num_tokens) * heads * head_dim;
  for_rows(a.num_tokens, work >= (int64_t{1} << 18) ? cpu::resolve_threads(0) : 1, [&](int32_t t) {
    const int32_t slot = a.slot_mapping[t];
    if (slot < 0) return;
    const int64_t block = slot / tpb;
    const int64_t off = slot % tpb;
    for (int32_t h = 0; h < heads; ++h) {
      const int64_t dst = ((block * heads + h) * tpb + off) * head_dim;
      const Src* ks = k + t * a.key_row_stride + static_cast<int64_t>(h) * head_dim;
      const Src* vs = v + t * a.value_row_stride + static_cast<int64_t>(h) * head_dim;
      if constexpr (std::is_same_v<Src, Dst>) {
        std::memcpy(kc + dst, ks, sizeof(Src) * head_dim);
        std::memcpy(vc + dst, vs, sizeof(Src) * head_dim);
      } else {
        convert_row(ks, kc + dst, head_dim);
        convert_row(vs, vc + dst, head_dim);
      }
    }
  });
}

}  // namespace

// One pass over the span in 16 independent lanes, each keeping its largest key and the first
// index holding it (integer compare-selects: gcc vectorizes them, float ones it does not without
// -ffast-math), and whether a NaN was seen; the lanes then give the span's largest key and, of
// the lanes holding it, the smallest index: the span's first occurrence.
void argmax_span(const float* x, int32_t begin, int32_t end, ArgmaxSpan& out) {
  constexpr int32_t kLanes = 16;
  int32_t best[kLanes], at[kLanes], nan[kLanes];
  for (int32_t j = 0; j < kLanes; ++j) {
    best[j] = INT32_MIN;  // below every non-NaN key (-inf's is 0x807fffff)
    at[j] = INT32_MAX;
    nan[j] = 0;
  }
  int32_t i = begin;
  for (; i + kLanes <= end; i += kLanes)
    for (int32_t j = 0; j < kLanes; ++j) {
      int32_t bits;
      std::memcpy(&bits, x + i + j, sizeof(bits));
      nan[j] |= (bits & INT32_MAX) > 0x7f800000;
      const int32_t key = bits ^ ((bits >> 31) & INT32_MAX);
      const bool above = key > best[j];
      best[j] = above ? key : best[j];
      at[j] = above ? i + j : at[j];
    }
  for (int32_t j = 0; i < end; ++i, ++j) {
    int32_t bits;
    std::memcpy(&bits, x + i, sizeof(bits));
    nan[j] |= (bits & INT32_MAX) > 0x7f800000;
    const int32_t key = bits ^ ((bits >> 31) & INT32_MAX);
    if (key > best[j]) {
      best[j] = key;
      at[j] = i;
    }
  }
  out = {-1, INT32_MIN, -1};
  int32_t any_nan = 0;
  for (int32_t j = 0; j < kLanes; ++j) {
    any_nan |= nan[j];
    if (at[j] == INT32_MAX) continue;  // a lane that saw nothing but NaNs (or nothing)
    if (out.index < 0 || best[j] > out.key || (best[j] == out.key && at[j] < out.index)) {
      out.key = best[j];
      out.index = at[j];
    }
  }
  if (any_nan) {
    for (i = begin; i < end; ++i) {
      int32_t bits;
      std::memcpy(&bits, x + i, sizeof(bits));
      if ((bits & INT32_MAX) > 0x7f800000) {
        out.first_nan = i;
        break;
      }
    }
  }
}

void rms_norm(const RmsNormArgs& a) {
  by_dtype(a.dtype, [&](auto* tag) { rms_norm_typed<std::remove_pointer_t<decltype(tag)>>(a); });
}

void rotary_embedding(const RotaryArgs& a) {
  by_dtype(a.dtype, [&](auto* tag) { rotary_typed<std::remove_pointer_t<decltype(tag)>>(a); });
}

void silu_mul(const SiluMulArgs& a) {
  by_dtype(a.dtype, [&](auto* tag) { silu_mul_typed<std::remove_pointer_t<decltype(tag)>>(a); });
}

void store_kv(const StoreKvArgs& a) {
  by_dtype(a.src_dtype, [&](auto* src) {
    by_dtype(a.cache_dtype, [&](auto* dst) {
      store_kv_typed<std::remove_pointer_t<decltype(src)>, std::remove_pointer_t<decltype(dst)>>(a);
    });
  });
}

}  // namespace pyengine::kernels::cpu::PYENGINE_ISA_NS
