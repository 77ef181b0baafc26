#!/usr/bin/env bash
# Cross-compile the C++ core and its tests for aarch64 Linux and run the tests (ctest) under
# user-mode qemu. No Python or torch needed: only the C++ core, tests/cpp and examples/cpp are
# built (the Python extension is built only under scikit-build).
#
#   scripts/cross_aarch64.sh [BUILD_DIR]        (default: build/aarch64)
#
# Environment: JOBS (build parallelism, default 2), CTEST_TIMEOUT (seconds per test, default 600),
# CMAKE_ARGS (extra arguments for the configure step).
# Needs Debian/Ubuntu's cross toolchain and qemu-user:
#   sudo apt-get install -y g++-aarch64-linux-gnu qemu-user
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR="${1:-build/aarch64}"
JOBS="${JOBS:-2}"
CTEST_TIMEOUT="${CTEST_TIMEOUT:-600}"
TOOLCHAIN="cmake/toolchains/aarch64-linux-gnu.cmake"

missing=()
for tool in cmake ctest aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ qemu-aarch64; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ! -d /usr/aarch64-linux-gnu/lib ]; then
  missing+=("/usr/aarch64-linux-gnu/lib (the aarch64 libc and libstdc++)")
fi
if [ "${#missing[@]}" -gt 0 ]; then
  echo "cross_aarch64.sh: missing: ${missing[*]}" >&2
  echo "Install the cross toolchain and user-mode qemu (Debian/Ubuntu):" >&2
  echo "  sudo apt-get install -y g++-aarch64-linux-gnu qemu-user" >&2
  exit 2
fi

echo "== toolchain =="
aarch64-linux-gnu-g++ --version | head -n 1
qemu-aarch64 --version | head -n 1
cmake --version | head -n 1

start=$SECONDS
echo "== configure ($BUILD_DIR) =="
# shellcheck disable=SC2086  # CMAKE_ARGS is a list of arguments
cmake -S . -B "$BUILD_DIR" --toolchain "$TOOLCHAIN" \
  -DPYENGINE_BUILD_TESTS=ON -DPYENGINE_CUDA=OFF -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-}

echo "== build (-j $JOBS) =="
cmake --build "$BUILD_DIR" -j "$JOBS"
built=$SECONDS

# Guard against a host build dir being reused by mistake: the tests must be aarch64 binaries.
probe="$BUILD_DIR/tests/cpp/test_scheduler"
if command -v file >/dev/null 2>&1 && ! file -b "$probe" | grep -q aarch64; then
  echo "cross_aarch64.sh: $probe is not an aarch64 binary: $(file -b "$probe")" >&2
  exit 1
fi

echo "== ctest under qemu-aarch64 =="
set +e
ctest --test-dir "$BUILD_DIR" --output-on-failure --timeout "$CTEST_TIMEOUT"
rc=$?
set -e
done_at=$SECONDS

echo "== summary =="
echo "aarch64 cross build: $((built - start)) s; ctest under qemu: $((done_at - built)) s"
if [ "$rc" -ne 0 ]; then
  echo "FAILED: ctest under qemu-aarch64 exited $rc (failing tests listed above)"
  exit "$rc"
fi
echo "OK: all C++ tests passed on aarch64 (qemu-aarch64)"
