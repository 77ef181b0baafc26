# cython: language_level=3
# distutils: language = c++
"""Thin, zero-copy Cython wrappers of the C++ core (csrc/)."""

include "_batch_manager.pxi"
include "_kernels.pxi"
include "_cuda_kernels.pxi"
include "_linear.pxi"
include "_quant.pxi"
include "_elementwise.pxi"
include "_decode.pxi"
include "_token_bitmask.pxi"
include "_sampling.pxi"
