// The C API of the CPU kernels (pyengine/c_api.h) over pyengine/kernels.h, cpu_linear.h and cpu_gemm.h.
#include <string>

#include "c_api/guard.h"
#include "pyengine/cpu_gemm.h"
#include "pyengine/cpu_isa.h"
#include "pyengine/cpu_linear.h"
#include "pyengine/kernels.h"

using pyengine::c_api::Error;
using pyengine::c_api::guarded;
using pyengine::c_api::ok;
using pyengine::c_api::require;

namespace {

pyengine::kernels::DType dtype(int32_t d, const char* name) {
  if (d < PE_FLOAT32 || d > PE_FLOAT16)
    throw Error{PE_ERR_INVALID_ARGUMENT, std::string(name) + ": not a pe_dtype: " + std::to_string(d)};
  return static_cast<pyengine::kernels::DType>(d);
}

}  // namespace

extern "C" {

pe_status pe_store_kv(const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
                      int32_t src_dtype, void* k_cache, void* v_cache, int32_t cache_dtype,
                      const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads, int32_t head_dim,
                      int32_t tokens_per_block, int32_t num_blocks) {
  return guarded([&] {
    pyengine::kernels::store_kv(key, value, key_row_stride, value_row_stride, dtype(src_dtype, "src_dtype"),
                                k_cache, v_cache, dtype(cache_dtype, "cache_dtype"), slot_mapping, num_tokens,
                                num_kv_heads, head_dim, tokens_per_block, num_blocks);
    return ok();
  });
}

pe_status pe_paged_attention(void* out, int64_t out_row_stride, const void* query, int64_t query_row_stride,
                             int32_t q_dtype, const void* k_cache, const void* v_cache, int32_t cache_dtype,
                             const int32_t* query_start_loc, const int32_t* seq_lens,
                             const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
                             int32_t max_blocks_per_seq, int32_t num_heads, int32_t num_kv_heads,
                             int32_t head_dim, int32_t tokens_per_block, int32_t num_blocks, float scale,
                             int32_t sliding_window, float softcap, int32_t num_threads) {
  return guarded([&] {
    pyengine::kernels::paged_attention(out, out_row_stride, query, query_row_stride, dtype(q_dtype, "q_dtype"),
                                       k_cache, v_cache, dtype(cache_dtype, "cache_dtype"), query_start_loc,
                                       seq_lens, block_tables, num_seqs, num_tokens, max_blocks_per_seq,
                                       num_heads, num_kv_heads, head_dim, tokens_per_block, num_blocks, scale,
                                       sliding_window, softcap, num_threads);
    return ok();
  });
}

pe_status pe_linear_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M, int32_t N,
                        int32_t K, int32_t num_threads) {
  return guarded([&] {
    pyengine::kernels::linear_f32(y, x, weight, bias, M, N, K, num_threads);
    return ok();
  });
}

pe_status pe_linear_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias,
                         int32_t M, int32_t N, int32_t K, int32_t num_threads) {
  return guarded([&] {
    pyengine::kernels::linear_bf16(y, x, weight, bias, M, N, K, num_threads);
    return ok();
  });
}

pe_status pe_gemm_f32(float* y, const float* x, const float* weight, const float* bias, int32_t M, int32_t N,
                      int32_t K, int32_t num_threads) {
  return guarded([&] {
    pyengine::kernels::gemm_f32(y, x, weight, bias, M, N, K, num_threads);
    return ok();
  });
}

pe_status pe_gemm_bf16(uint16_t* y, const uint16_t* x, const uint16_t* weight, const uint16_t* bias, int32_t M,
                       int32_t N, int32_t K, int32_t num_threads) {
  return guarded([&] {
    pyengine::kernels::gemm_bf16(y, x, weight, bias, M, N, K, num_threads);
    return ok();
  });
}

pe_status pe_cpu_isa_name(const char** out) {
  return guarded([&] {
    require(out, "out");
    *out = pyengine::cpu_isa_name(pyengine::cpu_isa());
    return ok();
  });
}

}  // extern "C"
