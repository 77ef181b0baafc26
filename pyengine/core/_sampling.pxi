# Cython binding of argmax_rows (csrc/include/pyengine/cpu_sampling.h). Included by _core.pyx;
# the torch-facing caller is the sampler's greedy path (pyengine/sampling/sampler.py).

from libc.stdint cimport int32_t, int64_t, uintptr_t

cdef extern from "pyengine/cpu_sampling.h" namespace "pyengine::kernels" nogil:
    void argmax_rows(int32_t* out, const float* logits, int64_t logits_stride, int32_t num_rows,
                     int32_t vocab_size, int32_t num_threads) except +


def _argmax_rows(uintptr_t out, uintptr_t logits, int64_t logits_stride, int32_t num_rows, int32_t vocab_size,
                 int32_t num_threads=1):
    """Raw argmax_rows (float32 logits -> int32 indices, torch.argmax's ties and NaNs; long rows
    split between num_threads threads). Raises ValueError naming the bad argument."""
    with nogil:
        argmax_rows(<int32_t*>out, <const float*>logits, logits_stride, num_rows, vocab_size, num_threads)
