# Cross-compile for aarch64 Linux with Debian's cross toolchain (g++-aarch64-linux-gnu) and run
# the test binaries through user-mode qemu (qemu-user):
#   cmake -S . -B build/aarch64 --toolchain cmake/toolchains/aarch64-linux-gnu.cmake \
#         -DPYENGINE_BUILD_TESTS=ON -DPYENGINE_CUDA=OFF
#   ctest --test-dir build/aarch64     # each test runs as: qemu-aarch64 -L <sysroot> <test>
# scripts/cross_aarch64.sh does all of this. Override the triple's prefix with
# -DPYENGINE_CROSS_PREFIX=... and the sysroot with -DPYENGINE_CROSS_SYSROOT=... if yours differ.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(PYENGINE_CROSS_PREFIX "aarch64-linux-gnu-" CACHE STRING "Prefix of the cross compilers")
set(PYENGINE_CROSS_SYSROOT "/usr/aarch64-linux-gnu" CACHE PATH
    "Target root: the aarch64 libc/libstdc++ (qemu -L and CMake's find root)")

set(CMAKE_C_COMPILER "${PYENGINE_CROSS_PREFIX}gcc")
set(CMAKE_CXX_COMPILER "${PYENGINE_CROSS_PREFIX}g++")

# Libraries and headers only from the target root; programs (tools run at build time) from the host.
set(CMAKE_FIND_ROOT_PATH "${PYENGINE_CROSS_SYSROOT}")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# ctest (and try_run) run target binaries through user-mode qemu; -L points the emulated dynamic
# loader at the aarch64 libc, libstdc++ and libgomp.
set(CMAKE_CROSSCOMPILING_EMULATOR "qemu-aarch64;-L;${PYENGINE_CROSS_SYSROOT}")

# Let try_compile projects (compiler checks, FindOpenMP) see overridden values too.
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES PYENGINE_CROSS_PREFIX PYENGINE_CROSS_SYSROOT)
