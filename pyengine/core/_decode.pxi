# Cython binding of the CPU decode-layers kernel (csrc/include/pyengine/cpu_decode.h).
# Included by _core.pyx. The torch-facing side is pyengine/layers/fused_decode.py.

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "pyengine/cpu_decode.h" namespace "pyengine::kernels" nogil:
    const int32_t kDecodeLayerPointers
    const int32_t kSlidingWindow
    const int32_t kUseRope
    const int32_t kMaxQuantLinearParts
    cdef struct DecodeShape:
        int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate
        float rms_norm_eps, scale
        float attn_softcap
        int32_t max_position, tokens_per_block, max_blocks_per_seq
        int32_t num_blocks
        DType cache_dtype
        DType dtype
        bint quantized
    cdef struct DecodeHead:
        const void* norm
        uintptr_t lm_head
        int32_t vocab
        bint quantized
    int64_t decode_scratch_elements(const DecodeShape& shape, int32_t num_tokens)
    int64_t decode_head_scratch_elements(const DecodeShape& shape, const DecodeHead& head, int32_t num_rows)
    void decode_head(float* logits, const void* h, int32_t num_tokens, const int32_t* rows, int32_t num_rows,
                     const DecodeShape& shape, const DecodeHead& head, void* scratch, int64_t scratch_elements,
                     int32_t num_threads) except +
    void decode_layers(void* h, int32_t num_tokens, const uintptr_t* layer_ptrs,
                       const DecodeShape& shape, const void* cos, const void* sin,
                       const int32_t* positions, const int32_t* slot_mapping,
                       const int32_t* query_start_loc, const int32_t* seq_lens,
                       const int32_t* block_tables, int32_t num_seqs, void* scratch,
                       int64_t scratch_elements, int32_t num_threads) except +


DECODE_LAYER_POINTERS = kDecodeLayerPointers
# the per-layer integers' columns of the layer table (after the tensor addresses)
DECODE_LAYER_SLIDING_WINDOW = kSlidingWindow
DECODE_LAYER_USE_ROPE = kUseRope
MAX_QUANT_LINEAR_PARTS = kMaxQuantLinearParts


cdef class CoreDecodeShape:
    """A model's DecodeShape, built once."""
    cdef DecodeShape s

    def __init__(self, *, int32_t num_layers, int32_t hidden, int32_t num_heads, int32_t num_kv_heads,
                 int32_t head_dim, int32_t intermediate, float rms_norm_eps, float scale,
                 int32_t max_position, int32_t tokens_per_block, int32_t max_blocks_per_seq,
                 int32_t num_blocks, int cache_dtype, int dtype, bint quantized=False,
                 float attn_softcap=0.0):
        self.s.num_layers = num_layers
        self.s.hidden = hidden
        self.s.num_heads = num_heads
        self.s.num_kv_heads = num_kv_heads
        self.s.head_dim = head_dim
        self.s.intermediate = intermediate
        self.s.rms_norm_eps = rms_norm_eps
        self.s.scale = scale
        self.s.attn_softcap = attn_softcap
        self.s.max_position = max_position
        self.s.tokens_per_block = tokens_per_block
        self.s.max_blocks_per_seq = max_blocks_per_seq
        self.s.num_blocks = num_blocks
        self.s.cache_dtype = <DType>cache_dtype
        self.s.dtype = <DType>dtype
        self.s.quantized = quantized

    def scratch_elements(self, int32_t num_tokens) -> int:
        return decode_scratch_elements(self.s, num_tokens)

    def run(self, uintptr_t h, int32_t num_tokens, uintptr_t layer_ptrs, uintptr_t cos, uintptr_t sin,
            uintptr_t positions, uintptr_t slot_mapping, uintptr_t query_start_loc, uintptr_t seq_lens,
            uintptr_t block_tables, int32_t num_seqs, uintptr_t scratch, int64_t scratch_elements,
            int32_t num_threads):
        """Raw decode_layers (addresses are data_ptr() values). Raises ValueError naming
        the bad argument."""
        with nogil:
            decode_layers(<void*>h, num_tokens, <const uintptr_t*>layer_ptrs, self.s,
                          <const void*>cos, <const void*>sin, <const int32_t*>positions,
                          <const int32_t*>slot_mapping, <const int32_t*>query_start_loc,
                          <const int32_t*>seq_lens, <const int32_t*>block_tables, num_seqs,
                          <void*>scratch, scratch_elements, num_threads)

    def head_scratch_elements(self, int32_t vocab, bint quantized, int32_t num_rows) -> int:
        cdef DecodeHead head
        head.norm = NULL
        head.lm_head = 0
        head.vocab = vocab
        head.quantized = quantized
        return decode_head_scratch_elements(self.s, head, num_rows)

    def head(self, uintptr_t logits, uintptr_t h, int32_t num_tokens, uintptr_t rows, int32_t num_rows,
             uintptr_t norm, uintptr_t lm_head, int32_t vocab, bint quantized, uintptr_t scratch,
             int64_t scratch_elements, int32_t num_threads):
        """Raw decode_head: the fp32 logits of `rows` of h after run() (addresses are data_ptr()
        values; lm_head: the weight's, or a QuantLinearDesc's when `quantized`). Raises
        ValueError naming the bad argument."""
        cdef DecodeHead head
        head.norm = <const void*>norm
        head.lm_head = lm_head
        head.vocab = vocab
        head.quantized = quantized
        with nogil:
            decode_head(<float*>logits, <const void*>h, num_tokens, <const int32_t*>rows, num_rows, self.s, head,
                        <void*>scratch, scratch_elements, num_threads)
