# Cython bindings of the CUDA attention kernels (csrc/include/pyengine/cuda_kernels.h).
# Included by _core.pyx. The torch-facing API (argument checks, dtype mapping, the current
# stream) is pyengine/cuda_kernels.py; these wrappers take raw device addresses
# (tensor.data_ptr()), sizes, the CUDA device index of those addresses, and the stream as an
# address (torch's stream.cuda_stream, a stream of that device). In a build without CUDA every
# launch raises RuntimeError (_cuda_kernels_built() is False); the workspace arithmetic answers
# in every build.

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "pyengine/cuda_kernels.h" namespace "pyengine::kernels::cuda" nogil:
    bint cuda_kernels_built()
    const char* cuda_architectures()

    void cuda_store_kv "pyengine::kernels::cuda::store_kv" (
        const void* key, const void* value, int64_t key_row_stride, int64_t value_row_stride,
        DType src_dtype, void* k_cache, void* v_cache, DType cache_dtype, float k_scale,
        float v_scale, const int32_t* slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
        int32_t head_dim, int32_t tokens_per_block, int32_t device, void* stream) except +

    size_t paged_attention_workspace_bytes(int32_t num_tokens, int32_t num_heads,
                                           int32_t head_dim, int32_t max_context_len) except +
    size_t paged_attention_batch_workspace_bytes(
        DType q_dtype, int32_t num_tokens, int32_t num_heads, int32_t head_dim,
        int32_t max_query_len, int32_t max_context_len, bint query_vector_aligned) except +
    int32_t paged_attention_split_k_rows(DType q_dtype, int32_t head_dim, int32_t max_seqs,
                                         int32_t max_tokens) except +

    void cuda_paged_attention "pyengine::kernels::cuda::paged_attention" (
        void* out, int64_t out_row_stride, const void* query, int64_t query_row_stride,
        DType q_dtype, const void* k_cache, const void* v_cache, DType cache_dtype,
        float k_scale, float v_scale, const int32_t* query_start_loc, const int32_t* seq_lens,
        const int32_t* block_tables, int32_t num_seqs, int32_t num_tokens,
        int32_t max_blocks_per_seq, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
        int32_t tokens_per_block, float scale, int32_t sliding_window, float softcap,
        int32_t max_query_len, int32_t max_context_len, void* workspace, size_t workspace_bytes,
        int32_t device, void* stream) except +


def _cuda_kernels_built():
    """True when this build has the CUDA kernels."""
    return bool(cuda_kernels_built())


def _cuda_architectures():
    """The CUDA architectures the kernels were compiled for, e.g. "80;90a" ("" without CUDA)."""
    return cuda_architectures().decode()


def _cuda_store_kv(uintptr_t key, uintptr_t value, int64_t key_row_stride,
                   int64_t value_row_stride, int src_dtype, uintptr_t k_cache,
                   uintptr_t v_cache, int cache_dtype, float k_scale, float v_scale,
                   uintptr_t slot_mapping, int32_t num_tokens, int32_t num_kv_heads,
                   int32_t head_dim, int32_t tokens_per_block, int32_t device, uintptr_t stream):
    """Raw CUDA store_kv: device addresses on CUDA device `device`, DType ints (3 = float8_e4m3
    cache), the stream as an address. Raises ValueError (naming the argument) on invalid
    arguments, RuntimeError when the launch fails, the GPU is older than compute capability 8.0
    or the build has no CUDA kernels."""
    with nogil:
        cuda_store_kv(<const void*>key, <const void*>value, key_row_stride, value_row_stride,
                      <DType>src_dtype, <void*>k_cache, <void*>v_cache, <DType>cache_dtype,
                      k_scale, v_scale, <const int32_t*>slot_mapping, num_tokens, num_kv_heads,
                      head_dim, tokens_per_block, device, <void*>stream)


def _cuda_paged_attention_workspace_bytes(int32_t num_tokens, int32_t num_heads,
                                          int32_t head_dim, int32_t max_context_len):
    """Bytes of device scratch enough for _cuda_paged_attention on every batch of at most
    `num_tokens` query rows (0: none)."""
    return paged_attention_workspace_bytes(num_tokens, num_heads, head_dim, max_context_len)


def _cuda_paged_attention_batch_workspace_bytes(int q_dtype, int32_t num_tokens, int32_t num_heads,
                                                int32_t head_dim, int32_t max_query_len,
                                                int32_t max_context_len, bint query_vector_aligned):
    """Bytes of device scratch one batch needs: 0 when it goes to the tensor-core kernel."""
    return paged_attention_batch_workspace_bytes(<DType>q_dtype, num_tokens, num_heads, head_dim,
                                                 max_query_len, max_context_len,
                                                 query_vector_aligned)


def _cuda_paged_attention_split_k_rows(int q_dtype, int32_t head_dim, int32_t max_seqs,
                                       int32_t max_tokens):
    """The most query rows a batch reaching the split-K kernel can have (batches of at most
    `max_seqs` sequences and `max_tokens` tokens, vector-aligned queries)."""
    return paged_attention_split_k_rows(<DType>q_dtype, head_dim, max_seqs, max_tokens)


def _cuda_paged_attention(uintptr_t out, int64_t out_row_stride, uintptr_t query,
                          int64_t query_row_stride, int q_dtype, uintptr_t k_cache,
                          uintptr_t v_cache, int cache_dtype, float k_scale, float v_scale,
                          uintptr_t query_start_loc, uintptr_t seq_lens, uintptr_t block_tables,
                          int32_t num_seqs, int32_t num_tokens, int32_t max_blocks_per_seq,
                          int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                          int32_t tokens_per_block, float scale, int32_t sliding_window,
                          int32_t max_query_len, int32_t max_context_len, uintptr_t workspace,
                          size_t workspace_bytes, int32_t device, uintptr_t stream,
                          float softcap=0.0):
    """Raw CUDA paged_attention: device addresses on CUDA device `device`, DType ints, the stream
    as an address; softcap (last, so that older positional calls keep their meaning) > 0
    soft-caps the logits. Raises ValueError (naming the argument) on invalid arguments, RuntimeError
    when the launch fails, the GPU is older than compute capability 8.0 or the build has no CUDA
    kernels."""
    with nogil:
        cuda_paged_attention(<void*>out, out_row_stride, <const void*>query, query_row_stride,
                             <DType>q_dtype, <const void*>k_cache, <const void*>v_cache,
                             <DType>cache_dtype, k_scale, v_scale,
                             <const int32_t*>query_start_loc, <const int32_t*>seq_lens,
                             <const int32_t*>block_tables, num_seqs, num_tokens,
                             max_blocks_per_seq, num_heads, num_kv_heads, head_dim,
                             tokens_per_block, scale, sliding_window, softcap, max_query_len,
                             max_context_len, <void*>workspace, workspace_bytes, device,
                             <void*>stream)
