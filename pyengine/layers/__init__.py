"""The model's building blocks over the C++ kernels: paged attention (one front end for the
CPU and CUDA kernels), linear layers, fused elementwise kernels and the one-call CPU decode
path. Each module checks tensor metadata only and hands raw addresses to ``pyengine.core``."""
