// decode_layers_bf16: see pyengine/cpu_decode.h. Composition only: every step is one of the
// CPU kernels, called with the arguments the Python model passes them.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dtype_convert.h"
#include "pyengine/cpu_decode.h"
#include "pyengine/cpu_elementwise.h"
#include "pyengine/cpu_linear.h"

namespace pyengine::kernels {

namespace {

struct Widths {
  int64_t q, kv, qkv, attn;
};

Widths widths(const DecodeShape& s) {
  const int64_t q = static_cast<int64_t>(s.num_heads) * s.head_dim;
  const int64_t kv = static_cast<int64_t>(s.num_kv_heads) * s.head_dim;
  return {q, kv, q + 2 * kv, q};
}

}  // namespace

int64_t decode_scratch_elements(const DecodeShape& s, int32_t num_tokens) {
  const Widths w = widths(s);
  // x, delta: hidden; qkv; attention output; gate_up: 2 * intermediate; act: intermediate
  return static_cast<int64_t>(num_tokens) * (2 * s.hidden + w.qkv + w.attn + 3 * s.intermediate);
}

void decode_layers_bf16(void* h_ptr, int32_t T, const uintptr_t* layer_ptrs, const DecodeShape& s,
                        const void* cos, const void* sin, const int32_t* positions,
                        const int32_t* slot_mapping, const int32_t* query_start_loc,
                        const int32_t* seq_lens, const int32_t* block_tables, int32_t num_seqs,
                        void* scratch, int64_t scratch_elements, int32_t num_threads) {
  if (T < 1 || T > kLinearBf16MaxRows)
    throw std::invalid_argument("num_tokens: must be in [1, " + std::to_string(kLinearBf16MaxRows) +
                                "], got " + std::to_string(T));
  if (h_ptr == nullptr || layer_ptrs == nullptr || scratch == nullptr)
    throw std::invalid_argument("h/layer_ptrs/scratch: null pointer");
  if (scratch_elements < decode_scratch_elements(s, T))
    throw std::invalid_argument("scratch: " + std::to_string(scratch_elements) + " elements, needs " +
                                std::to_string(decode_scratch_elements(s, T)));
  const Widths w = widths(s);
  const DType bf16 = DType::kBFloat16;
  auto* h = static_cast<uint16_t*>(h_ptr);
  auto* x = static_cast<uint16_t*>(scratch);
  uint16_t* delta = x + static_cast<int64_t>(T) * s.hidden;
  uint16_t* qkv = delta + static_cast<int64_t>(T) * s.hidden;
  uint16_t* attn = qkv + T * w.qkv;
  uint16_t* gate_up = attn + T * w.attn;
  uint16_t* act = gate_up + static_cast<int64_t>(T) * 2 * s.intermediate;
  auto u16 = [](uintptr_t p) { return reinterpret_cast<const uint16_t*>(p); };

  for (int32_t l = 0; l < s.num_layers; ++l) {
    const uintptr_t* p = layer_ptrs + static_cast<int64_t>(l) * kDecodeLayerPointers;
    if (l == 0)  // x = norm(h)
      rms_norm(x, s.hidden, h, s.hidden, nullptr, s.hidden, u16(p[kInputNorm]), bf16, T, s.hidden,
               s.rms_norm_eps, num_threads);
    else  // h += delta (the layer before's MLP output); x = norm(h)
      rms_norm(x, s.hidden, delta, s.hidden, h, s.hidden, u16(p[kInputNorm]), bf16, T, s.hidden,
               s.rms_norm_eps, num_threads);
    linear_bf16(qkv, x, u16(p[kQkv]), u16(p[kQkvBias]), T, static_cast<int32_t>(w.qkv), s.hidden,
                num_threads);
    uint16_t* q = qkv;
    uint16_t* k = qkv + w.q;
    uint16_t* v = k + w.kv;
    if (p[kQNorm] != 0) {  // per-head RMSNorm of q and k, one token's heads at a time (in place)
      for (int32_t t = 0; t < T; ++t) {
        rms_norm(q + t * w.qkv, s.head_dim, q + t * w.qkv, s.head_dim, nullptr, s.head_dim,
                 u16(p[kQNorm]), bf16, s.num_heads, s.head_dim, s.rms_norm_eps, 1);
        rms_norm(k + t * w.qkv, s.head_dim, k + t * w.qkv, s.head_dim, nullptr, s.head_dim,
                 u16(p[kKNorm]), bf16, s.num_kv_heads, s.head_dim, s.rms_norm_eps, 1);
      }
    }
    rotary_embedding(q, w.qkv, T, s.num_heads, s.head_dim, cos, sin, s.max_position, positions, bf16,
                     num_threads);
    rotary_embedding(k, w.qkv, T, s.num_kv_heads, s.head_dim, cos, sin, s.max_position, positions,
                     bf16, num_threads);
    auto* k_cache = reinterpret_cast<void*>(p[kKCache]);
    auto* v_cache = reinterpret_cast<void*>(p[kVCache]);
    store_kv(k, v, w.qkv, w.qkv, bf16, k_cache, v_cache, s.cache_dtype, slot_mapping, T,
             s.num_kv_heads, s.head_dim, s.tokens_per_block);
    paged_attention(attn, w.attn, q, w.qkv, bf16, k_cache, v_cache, s.cache_dtype, query_start_loc,
                    seq_lens, block_tables, num_seqs, s.max_blocks_per_seq, s.num_heads,
                    s.num_kv_heads, s.head_dim, s.tokens_per_block, s.scale, s.sliding_window,
                    num_threads);
    linear_bf16(delta, attn, u16(p[kO]), nullptr, T, s.hidden, static_cast<int32_t>(w.attn),
                num_threads);
    // h += delta; x = norm(h)
    rms_norm(x, s.hidden, delta, s.hidden, h, s.hidden, u16(p[kPostNorm]), bf16, T, s.hidden,
             s.rms_norm_eps, num_threads);
    linear_bf16(gate_up, x, u16(p[kGateUp]), nullptr, T, 2 * s.intermediate, s.hidden, num_threads);
    silu_mul(act, gate_up, bf16, T, s.intermediate, num_threads);
    linear_bf16(delta, act, u16(p[kDown]), nullptr, T, s.hidden, s.intermediate, num_threads);
  }
  // the last layer's residual add, rounded as transformers' bf16 add
  for (int64_t i = 0; i < static_cast<int64_t>(T) * s.hidden; ++i)
    h[i] = cpu::f32_to_bf16(cpu::bf16_to_f32(h[i]) + cpu::bf16_to_f32(delta[i]));
}

}  // namespace pyengine::kernels
