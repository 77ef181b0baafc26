# Cython binding of apply_token_bitmask (csrc/include/pyengine/token_bitmask.h). Included by
# _core.pyx; the torch-facing caller is the sampler (pyengine/sampling/sampler.py).

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "pyengine/token_bitmask.h" namespace "pyengine::kernels" nogil:
    void apply_token_bitmask(float* logits, int64_t logits_stride, const int32_t* bitmask,
                             int64_t bitmask_stride, int32_t num_rows, int32_t vocab_size,
                             int32_t num_threads) except +


def _apply_token_bitmask(uintptr_t logits, int64_t logits_stride, uintptr_t bitmask, int64_t bitmask_stride,
                         int32_t num_rows, int32_t vocab_size, int32_t num_threads):
    """Raw apply_token_bitmask (float32 logits, in place). Raises ValueError naming the bad argument."""
    with nogil:
        apply_token_bitmask(<float*>logits, logits_stride, <const int32_t*>bitmask, bitmask_stride, num_rows,
                            vocab_size, num_threads)
