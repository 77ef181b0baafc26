# Cython bindings of the CPU attention kernels (csrc/include/pyengine/kernels.h).
# Included by _core.pyx. The torch-facing API (argument checks, dtype mapping) is
# pyengine/layers/attention.py; these wrappers take raw addresses (tensor.data_ptr()) and sizes.

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "pyengine/kernels.h" namespace "pyengine::kernels" nogil:
    cpdef enum class DType(int32_t):
        kFloat32
        kBFloat16
        kFloat16
        kFloat8E4M3

    int dtype_size(DType dtype) except +

    void check_kv_slots(const int32_t* slot_mapping, int32_t num_tokens, int32_t tokens_per_block,
                        int32_t num_blocks) except +
    void check_attention_indices(const int32_t* query_start_loc, const int32_t* seq_lens,
                                 const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
                                 int32_t max_blocks_per_seq, int32_t tokens_per_block,
                                 int32_t num_blocks, int32_t sliding_window) except +

    void store_kv(const void* key, const void* value, int64_t key_row_stride,
                  int64_t value_row_stride, DType src_dtype, void* k_cache, void* v_cache,
                  DType cache_dtype, const int32_t* slot_mapping, int32_t num_tokens,
                  int32_t num_kv_heads, int32_t head_dim, int32_t tokens_per_block,
                  int32_t num_blocks) except +

    void paged_attention(void* out, int64_t out_row_stride, const void* query,
                         int64_t query_row_stride, DType q_dtype, const void* k_cache,
                         const void* v_cache, DType cache_dtype, const int32_t* query_start_loc,
                         const int32_t* seq_lens, const int32_t* block_tables, int32_t num_seqs,
                         int32_t num_tokens, int32_t max_blocks_per_seq, int32_t num_heads,
                         int32_t num_kv_heads, int32_t head_dim, int32_t tokens_per_block,
                         int32_t num_blocks, float scale, int32_t sliding_window,
                         float softcap, int32_t num_threads) except +


def _dtype_size(int dtype):
    """Size in bytes of one element of DType `dtype` (0 fp32, 1 bf16, 2 fp16)."""
    return dtype_size(<DType>dtype)


def _check_kv_slots(uintptr_t slot_mapping, int32_t num_tokens, int32_t tokens_per_block,
                    int32_t num_blocks):
    """The slot check of store_kv on a host int32 array (address): ValueError naming the entry."""
    check_kv_slots(<const int32_t*>slot_mapping, num_tokens, tokens_per_block, num_blocks)


def _check_attention_indices(uintptr_t query_start_loc, uintptr_t seq_lens, uintptr_t block_tables,
                             int32_t num_seqs, int32_t num_tokens, int32_t max_blocks_per_seq,
                             int32_t tokens_per_block, int32_t num_blocks, int32_t sliding_window):
    """The index checks of paged_attention on host int32 arrays (addresses): ValueError naming
    the argument and the value."""
    check_attention_indices(<const int32_t*>query_start_loc, <const int32_t*>seq_lens,
                            <const int32_t*>block_tables, num_seqs, num_tokens, max_blocks_per_seq,
                            tokens_per_block, num_blocks, sliding_window)


def _store_kv(uintptr_t key, uintptr_t value, int64_t key_row_stride, int64_t value_row_stride,
              int src_dtype, uintptr_t k_cache, uintptr_t v_cache, int cache_dtype,
              uintptr_t slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
              int32_t head_dim, int32_t tokens_per_block, int32_t num_blocks):
    """Raw store_kv: addresses are tensor.data_ptr() values, dtypes DType ints. Raises ValueError
    (naming the argument) on invalid arguments, slots beyond the cache's included."""
    with nogil:
        store_kv(<const void*>key, <const void*>value, key_row_stride, value_row_stride,
                 <DType>src_dtype, <void*>k_cache, <void*>v_cache, <DType>cache_dtype,
                 <const int32_t*>slot_mapping, num_tokens, num_kv_heads, head_dim,
                 tokens_per_block, num_blocks)


def _paged_attention(uintptr_t out, int64_t out_row_stride, uintptr_t query,
                     int64_t query_row_stride, int q_dtype, uintptr_t k_cache,
                     uintptr_t v_cache, int cache_dtype, uintptr_t query_start_loc,
                     uintptr_t seq_lens, uintptr_t block_tables, int32_t num_seqs,
                     int32_t num_tokens, int32_t max_blocks_per_seq, int32_t num_heads,
                     int32_t num_kv_heads, int32_t head_dim, int32_t tokens_per_block,
                     int32_t num_blocks, float scale, int32_t sliding_window, int32_t num_threads,
                     float softcap=0.0):
    """Raw paged_attention: addresses are tensor.data_ptr() values, dtypes DType ints; softcap
    (last, so that older positional calls keep their meaning) > 0 soft-caps the logits. Raises
    ValueError (naming the argument) on invalid arguments, indices outside the cache or the
    query rows included."""
    with nogil:
        paged_attention(<void*>out, out_row_stride, <const void*>query, query_row_stride,
                        <DType>q_dtype, <const void*>k_cache, <const void*>v_cache,
                        <DType>cache_dtype, <const int32_t*>query_start_loc,
                        <const int32_t*>seq_lens, <const int32_t*>block_tables, num_seqs,
                        num_tokens, max_blocks_per_seq, num_heads, num_kv_heads, head_dim,
                        tokens_per_block, num_blocks, scale, sliding_window, softcap,
                        num_threads)
