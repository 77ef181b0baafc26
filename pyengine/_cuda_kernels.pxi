# Cython bindings of the CUDA kernels (csrc/include/pyengine/cuda_kernels.h). Placeholder
# until the kernels land: only the build queries.

cdef extern from "pyengine/cuda_kernels.h" namespace "pyengine::kernels::cuda" nogil:
    bint cuda_kernels_built()
    const char* cuda_architectures()


def _cuda_kernels_built():
    """True when this build carries the CUDA kernels."""
    return cuda_kernels_built()


def _cuda_architectures():
    """The CUDA architectures the kernels were built for ("" without CUDA)."""
    return cuda_architectures().decode()
