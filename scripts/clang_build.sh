#!/usr/bin/env bash
# Build the C++ core and its tests with clang and run them (ctest): Debian's clang has no
# OpenMP runtime (libomp-dev) by default, so this is also the build without OpenMP
# (PYENGINE_OPENMP=AUTO finds none; the kernels run on the calling thread), as on macOS.
# Only what the tests need is built: no Python extension, no CUDA kernels.
#
#   scripts/clang_build.sh [BUILD_DIR]        (default: build/clang)
#
# Environment: JOBS (build parallelism, default 2), CTEST_TIMEOUT (seconds per test, default
# 600), CMAKE_ARGS (extra arguments for the configure step, e.g. -DPYENGINE_OPENMP=ON).
# Installs clang with apt-get when it is missing (sudo unless root).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${1:-build/clang}"
JOBS="${JOBS:-2}"
CTEST_TIMEOUT="${CTEST_TIMEOUT:-600}"

if ! command -v clang >/dev/null || ! command -v clang++ >/dev/null; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q clang >/dev/null || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q clang >/dev/null; }
fi

echo "== toolchain =="
clang++ --version | head -n 1
cmake --version | head -n 1

start=$SECONDS
echo "== configure ($BUILD_DIR) =="
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DPYENGINE_BUILD_TESTS=ON -DPYENGINE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}

echo "== build (-j $JOBS) =="
cmake --build "$BUILD_DIR" -j "$JOBS"
built=$SECONDS

echo "== ctest =="
set +e
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout "$CTEST_TIMEOUT"
rc=$?
set -e
done_at=$SECONDS

echo "== summary =="
echo "clang build: $((built - start)) s; ctest: $((done_at - built)) s"
if [ "$rc" -ne 0 ]; then
  echo "FAILED: ctest of the clang build exited $rc (failing tests listed above)"
  exit "$rc"
fi
echo "OK: all C++ tests passed with clang"
