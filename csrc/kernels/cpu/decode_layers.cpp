// decode_layers: see pyengine/cpu_decode.h. Composition only: every step is one of the CPU
// kernels, called with the arguments the Python model passes them.
#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "../attention_checks.h"
#include "dtype_convert.h"
#include "pyengine/cpu_decode.h"
#include "pyengine/cpu_elementwise.h"
#include "pyengine/cpu_gemm.h"
#include "pyengine/cpu_linear.h"
#include "pyengine/cpu_quant.h"

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

// A quantized linear layer: each row group fills its columns of y.
void linear_quantized(float* y, const float* x, const QuantLinearDesc& w, const float* bias, int32_t M,
                      int64_t N, int32_t K, int32_t num_threads) {
  int64_t rows = 0;
  for (int64_t i = 0; i < w.num_parts && i < kMaxQuantLinearParts; ++i) rows += w.parts[i].rows;
  if (w.num_parts < 1 || w.num_parts > kMaxQuantLinearParts || rows != N)
    throw std::invalid_argument("layer_ptrs: a quantized linear layer of " + std::to_string(N) + " rows has " +
                                std::to_string(w.num_parts) + " row groups of " + std::to_string(rows) +
                                " rows in all");
  int64_t row = 0;
  for (int64_t i = 0; i < w.num_parts; ++i) {
    const QuantLinearPart& p = w.parts[i];
    linear_quant(y + row, N, x, K, M, p.data, static_cast<QuantType>(p.type), static_cast<int32_t>(p.rows), K,
                 bias == nullptr ? nullptr : bias + row, num_threads);
    row += p.rows;
  }
}

// The linear kernel of the model's dtype (or quantized weights), on raw addresses: for bf16 and
// fp32, the decode kernel or the GEMM by the row count, as the Python model's linears choose.
void linear(DType dtype, bool quantized, void* y, const void* x, uintptr_t w, uintptr_t bias, int32_t M,
            int64_t N, int32_t K, int32_t num_threads) {
  const bool gemm = gemm_preferred(M);
  if (quantized)
    linear_quantized(static_cast<float*>(y), static_cast<const float*>(x),
                     *reinterpret_cast<const QuantLinearDesc*>(w), reinterpret_cast<const float*>(bias), M, N,
                     K, num_threads);
  else if (dtype == DType::kBFloat16)
    (gemm ? gemm_bf16 : linear_bf16)(static_cast<uint16_t*>(y), static_cast<const uint16_t*>(x),
                                     reinterpret_cast<const uint16_t*>(w), reinterpret_cast<const uint16_t*>(bias),
                                     M, static_cast<int32_t>(N), K, num_threads);
  else
    (gemm ? gemm_f32 : linear_f32)(static_cast<float*>(y), static_cast<const float*>(x),
                                   reinterpret_cast<const float*>(w), reinterpret_cast<const float*>(bias), M,
                                   static_cast<int32_t>(N), K, num_threads);
}

// The per-layer integers of the layer table (cpu_decode.h), all checked before the first layer
// runs, so a bad entry leaves h and the caches untouched.
void check_layer_settings(const uintptr_t* layer_ptrs, int32_t num_layers) {
  for (int32_t l = 0; l < num_layers; ++l) {
    const uintptr_t* p = layer_ptrs + static_cast<int64_t>(l) * kDecodeLayerPointers;
    const auto window = static_cast<int64_t>(p[kSlidingWindow]);
    if (window < 0 || window > INT32_MAX)
      throw std::invalid_argument("layer_ptrs: layer " + std::to_string(l) + "'s sliding window is " +
                                  std::to_string(window) + " (must be in [0, 2^31), 0 = full attention)");
    const auto use_rope = static_cast<int64_t>(p[kUseRope]);
    if (use_rope != 0 && use_rope != 1)
      throw std::invalid_argument("layer_ptrs: layer " + std::to_string(l) + "'s RoPE flag is " +
                                  std::to_string(use_rope) + " (must be 0 or 1)");
  }
}

// The activations' and weights' dtype decode_layers and decode_head take.
void check_dtype(const DecodeShape& s, bool quantized) {
  if (s.dtype != DType::kBFloat16 && s.dtype != DType::kFloat32)
    throw std::invalid_argument("shape.dtype: decode_layers takes bfloat16 or float32, got DType " +
                                std::to_string(static_cast<int32_t>(s.dtype)));
  if (quantized && s.dtype != DType::kFloat32)
    throw std::invalid_argument("shape.dtype: quantized weights compute with float32 activations");
}

// A row count one call takes: 1..kLinearMaxRows (what the linear kernels take at once).
void check_rows(const char* name, int32_t n) {
  if (n < 1 || n > kLinearMaxRows)
    throw std::invalid_argument(std::string(name) + ": must be in [1, " + std::to_string(kLinearMaxRows) +
                                "], got " + std::to_string(n));
}

}  // namespace

int64_t decode_scratch_elements(const DecodeShape& s, int32_t num_tokens) {
  const Widths w = widths(s);
  // x, delta: hidden; qkv; attention output; gate_up: 2 * intermediate; act: intermediate
  return static_cast<int64_t>(num_tokens) * (2 * s.hidden + w.qkv + w.attn + 3 * s.intermediate);
}

void decode_layers(void* h, int32_t T, const uintptr_t* layer_ptrs, const DecodeShape& s,
                   const void* cos, const void* sin, const int32_t* positions,
                   const int32_t* slot_mapping, const int32_t* query_start_loc,
                   const int32_t* seq_lens, const int32_t* block_tables, int32_t num_seqs,
                   void* scratch, int64_t scratch_elements, int32_t num_threads) {
  check_dtype(s, s.quantized);
  check_rows("num_tokens", T);
  if (h == nullptr || layer_ptrs == nullptr || scratch == nullptr)
    throw std::invalid_argument("h/layer_ptrs/scratch: null pointer");
  if (scratch_elements < decode_scratch_elements(s, T))
    throw std::invalid_argument("scratch: " + std::to_string(scratch_elements) + " elements, needs " +
                                std::to_string(decode_scratch_elements(s, T)));
  check_layer_settings(layer_ptrs, s.num_layers);
  check_attention_softcap(s.attn_softcap);  // (paged_attention's check, before any layer runs)
  const Widths w = widths(s);
  const DType dt = s.dtype;
  const int64_t esize = dt == DType::kBFloat16 ? 2 : 4;
  // Element offsets into a buffer of dtype `dt`.
  auto at = [esize](void* base, int64_t elements) {
    return static_cast<void*>(static_cast<char*>(base) + elements * esize);
  };
  void* x = scratch;
  void* delta = at(x, static_cast<int64_t>(T) * s.hidden);
  void* qkv = at(delta, static_cast<int64_t>(T) * s.hidden);
  void* attn = at(qkv, T * w.qkv);
  void* gate_up = at(attn, T * w.attn);
  void* act = at(gate_up, static_cast<int64_t>(T) * 2 * s.intermediate);
  auto ptr = [](uintptr_t p) { return reinterpret_cast<const void*>(p); };

  for (int32_t l = 0; l < s.num_layers; ++l) {
    const uintptr_t* p = layer_ptrs + static_cast<int64_t>(l) * kDecodeLayerPointers;
    if (l == 0)  // x = norm(h)
      rms_norm(x, s.hidden, h, s.hidden, nullptr, s.hidden, ptr(p[kInputNorm]), dt, T, s.hidden,
               s.rms_norm_eps, num_threads);
    else  // h += delta (the layer before's MLP output); x = norm(h)
      rms_norm(x, s.hidden, delta, s.hidden, h, s.hidden, ptr(p[kInputNorm]), dt, T, s.hidden,
               s.rms_norm_eps, num_threads);
    linear(s.dtype, s.quantized, qkv, x, p[kQkv], p[kQkvBias], T, w.qkv, s.hidden, num_threads);
    void* q = qkv;
    void* k = at(qkv, w.q);
    void* v = at(k, w.kv);
    if (p[kQNorm] != 0) {  // per-head RMSNorm of q and k, one token's heads at a time (in place)
      for (int32_t t = 0; t < T; ++t) {
        void* qt = at(q, t * w.qkv);
        void* kt = at(k, t * w.qkv);
        rms_norm(qt, s.head_dim, qt, s.head_dim, nullptr, s.head_dim, ptr(p[kQNorm]), dt,
                 s.num_heads, s.head_dim, s.rms_norm_eps, 1);
        rms_norm(kt, s.head_dim, kt, s.head_dim, nullptr, s.head_dim, ptr(p[kKNorm]), dt,
                 s.num_kv_heads, s.head_dim, s.rms_norm_eps, 1);
      }
    }
    if (p[kUseRope] != 0) {  // a NoPE layer attends with q and k as projected (and normed)
      rotary_embedding(q, w.qkv, T, s.num_heads, s.head_dim, cos, sin, s.max_position, positions,
                       dt, num_threads);
      rotary_embedding(k, w.qkv, T, s.num_kv_heads, s.head_dim, cos, sin, s.max_position,
                       positions, dt, num_threads);
    }
    auto* k_cache = reinterpret_cast<void*>(p[kKCache]);
    auto* v_cache = reinterpret_cast<void*>(p[kVCache]);
    store_kv(k, v, w.qkv, w.qkv, dt, k_cache, v_cache, s.cache_dtype, slot_mapping, T,
             s.num_kv_heads, s.head_dim, s.tokens_per_block, s.num_blocks);
    paged_attention(attn, w.attn, q, w.qkv, dt, k_cache, v_cache, s.cache_dtype, query_start_loc,
                    seq_lens, block_tables, num_seqs, T, s.max_blocks_per_seq, s.num_heads,
                    s.num_kv_heads, s.head_dim, s.tokens_per_block, s.num_blocks, s.scale,
                    static_cast<int32_t>(p[kSlidingWindow]), s.attn_softcap, num_threads);
    linear(s.dtype, s.quantized, delta, attn, p[kO], 0, T, s.hidden, static_cast<int32_t>(w.attn), num_threads);
    // h += delta; x = norm(h)
    rms_norm(x, s.hidden, delta, s.hidden, h, s.hidden, ptr(p[kPostNorm]), dt, T, s.hidden,
             s.rms_norm_eps, num_threads);
    linear(s.dtype, s.quantized, gate_up, x, p[kGateUp], 0, T, 2 * static_cast<int64_t>(s.intermediate), s.hidden,
           num_threads);
    silu_mul(act, gate_up, dt, T, s.intermediate, num_threads);
    linear(s.dtype, s.quantized, delta, act, p[kDown], 0, T, s.hidden, s.intermediate, num_threads);
  }
  // the last layer's residual add, rounded as transformers' add in the model's dtype
  const int64_t n = static_cast<int64_t>(T) * s.hidden;
  if (dt == DType::kBFloat16) {
    auto* hb = static_cast<uint16_t*>(h);
    const auto* db = static_cast<const uint16_t*>(delta);
    for (int64_t i = 0; i < n; ++i)
      hb[i] = cpu::f32_to_bf16(cpu::bf16_to_f32(hb[i]) + cpu::bf16_to_f32(db[i]));
  } else {
    auto* hf = static_cast<float*>(h);
    const auto* df = static_cast<const float*>(delta);
    for (int64_t i = 0; i < n; ++i) hf[i] += df[i];
  }
}

int64_t decode_head_scratch_elements(const DecodeShape& s, const DecodeHead& head, int32_t num_rows) {
  // the normed rows; bf16: the logits before they are widened to fp32
  const int64_t logits = s.dtype == DType::kBFloat16 ? static_cast<int64_t>(head.vocab) : 0;
  return static_cast<int64_t>(num_rows) * (s.hidden + logits);
}

void decode_head(float* logits, const void* h, int32_t T, const int32_t* rows, int32_t num_rows,
                 const DecodeShape& s, const DecodeHead& head, void* scratch, int64_t scratch_elements,
                 int32_t num_threads) {
  check_dtype(s, head.quantized);
  check_rows("num_tokens", T);
  check_rows("num_rows", num_rows);
  if (head.vocab < 1)
    throw std::invalid_argument("head.vocab: must be at least 1, got " + std::to_string(head.vocab));
  if (logits == nullptr || h == nullptr || rows == nullptr || scratch == nullptr || head.norm == nullptr ||
      head.lm_head == 0)
    throw std::invalid_argument("logits/h/rows/scratch/head.norm/head.lm_head: null pointer");
  if (scratch_elements < decode_head_scratch_elements(s, head, num_rows))
    throw std::invalid_argument("scratch: " + std::to_string(scratch_elements) + " elements, needs " +
                                std::to_string(decode_head_scratch_elements(s, head, num_rows)));
  for (int32_t i = 0; i < num_rows; ++i)
    if (rows[i] < 0 || rows[i] >= T)
      throw std::invalid_argument("rows: entry " + std::to_string(i) + " is " + std::to_string(rows[i]) +
                                  ", outside [0, " + std::to_string(T) + ")");
  const int64_t esize = s.dtype == DType::kBFloat16 ? 2 : 4;
  char* x = static_cast<char*>(scratch);
  const char* hc = static_cast<const char*>(h);
  const int64_t row_bytes = static_cast<int64_t>(s.hidden) * esize;
  // each row normed on its own: a row's result does not depend on the others
  for (int32_t i = 0; i < num_rows; ++i)
    rms_norm(x + i * row_bytes, s.hidden, hc + rows[i] * row_bytes, s.hidden, nullptr, s.hidden, head.norm,
             s.dtype, 1, s.hidden, s.rms_norm_eps, 1);
  if (s.dtype == DType::kBFloat16) {  // bf16 logits (as the model's dtype rounds them), then widened
    auto* y = reinterpret_cast<uint16_t*>(x + num_rows * row_bytes);
    linear(s.dtype, false, y, x, head.lm_head, 0, num_rows, head.vocab, s.hidden, num_threads);
    const int64_t n = static_cast<int64_t>(num_rows) * head.vocab;
    for (int64_t i = 0; i < n; ++i) logits[i] = cpu::bf16_to_f32(y[i]);
  } else {
    linear(s.dtype, head.quantized, logits, x, head.lm_head, 0, num_rows, head.vocab, s.hidden, num_threads);
  }
}

}  // namespace pyengine::kernels
