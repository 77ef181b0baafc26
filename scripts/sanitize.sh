#!/usr/bin/env bash
# The C++ core under gcc's sanitizers (CMake option PYENGINE_SANITIZE, cmake/sanitize.cmake):
#   1. ASan + UBSan: the C++ tests (ctest), then Python tests that drive the core (batch manager,
#      KV cache manager, CPU attention/linear/quantized kernels) against an instrumented build of
#      the extension;
#   2. TSan: the C++ tests that start threads of their own (not the OpenMP kernels': see
#      scripts/sanitizers/one_kernel_thread.py), and the overlap loop's tests (its forward runs
#      on a worker thread).
# Each sanitizer gets its own virtual environment and non-editable, CUDA-off build under BUILD_DIR;
# the developer's editable install is neither used nor rebuilt.
#
#   scripts/sanitize.sh [BUILD_DIR]        (default: build/sanitize)
#
# Environment: PYTHON (the interpreter with torch, default python), JOBS (build parallelism,
# default 2), ASAN_TESTS / TSAN_TESTS (test files or node ids, relative to the repository root,
# that replace the default lists below; TSAN_TESTS=skip skips the TSan stage), TSAN_CTESTS (a
# ctest -R regular expression).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

BUILD_DIR="$(realpath -m "${1:-build/sanitize}")"
PYTHON="${PYTHON:-python}"
export CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-2}"
read -r -a ASAN_TESTS <<< "${ASAN_TESTS:-tests/test_core_buffers.py tests/test_quant_kernels.py tests/test_kernels.py tests/test_attention_softcap.py tests/test_cpu_fused.py tests/test_cpu_linear.py tests/test_cpu_gemm.py tests/test_engine_api.py tests/test_quant_engine.py tests/test_atomic_step.py tests/test_prefix_reuse.py tests/test_overlap.py tests/test_soak.py}"
read -r -a TSAN_TESTS <<< "${TSAN_TESTS:-tests/test_overlap.py tests/test_overlap_regressions.py tests/test_engine_threads.py tests/test_step_faults.py::test_ctrl_c_while_the_worker_is_still_in_the_forward}"
TSAN_CTESTS="${TSAN_CTESTS:-^test_cuda_smem_opt_in\$}"

# The preloaded runtimes: python itself is not instrumented, so the sanitizer's runtime must be
# loaded first; libstdc++ too, else ASan cannot find the real __cxa_throw when it intercepts
# the first C++ exception ("CHECK failed: ... real___cxa_throw") and the process dies.
runtime() { gcc -print-file-name="$1"; }
LIBSTDCXX="$(runtime libstdc++.so)"

# make_env NAME SANITIZERS [CMAKE_DEFINE...]: a virtual environment BUILD_DIR/NAME-venv with
# pyengine built with -fsanitize=SANITIZERS in BUILD_DIR/NAME.
make_env() {
  local name=$1 sanitizers=$2; shift 2
  local venv="$BUILD_DIR/$name-venv"
  if [ ! -x "$venv/bin/python" ]; then
    "$PYTHON" -m venv "$venv"
    # torch and the build tools come from PYTHON's site-packages, listed as plain paths: a
    # --system-site-packages venv would also run their .pth files, among them the editable
    # install's import hook, which would load the uninstrumented extension instead of ours.
    "$PYTHON" -c 'import site; print("\n".join(site.getsitepackages() + [site.getusersitepackages()] * bool(site.ENABLE_USER_SITE)))' \
      > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/base_site_packages.pth"
  fi
  # the build backend (pyproject.toml's build-system.requires) in the venv itself: the build
  # below runs without isolation, and PYTHON need not have it (pip install -e . isolates it)
  local requires
  read -r -a requires <<< "$("$venv/bin/python" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')"
  "$venv/bin/python" -m pip install -q "${requires[@]}"
  local define=(-DPYENGINE_SANITIZE="$sanitizers" -DPYENGINE_CUDA=OFF "$@")
  local settings=(--config-settings=build-dir="$BUILD_DIR/$name" --config-settings=cmake.build-type=Debug)
  for d in "${define[@]}"; do settings+=(--config-settings=cmake.define."${d#-D}"); done
  "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps --force-reinstall "${settings[@]}" "$REPO"
}

# check_env NAME RUNTIME [LIB...]: the venv imports pyengine, and its extension, from itself (not
# the source tree or another install), and the extension is linked with the sanitizer runtime
# RUNTIME (preloaded here) and the LIBs.
check_env() {
  local venv="$BUILD_DIR/$1-venv" runtime_lib=$2
  local so lib
  so="$(cd "$BUILD_DIR" && env LD_PRELOAD="$(runtime "$runtime_lib.so") $LIBSTDCXX" ASAN_OPTIONS=detect_leaks=0 \
         "$venv/bin/python" -c '
import os, sys
import pyengine, pyengine.core._core as core
prefix = os.path.realpath(sys.prefix) + os.sep
for m in (pyengine, core):
    assert os.path.realpath(m.__file__).startswith(prefix), f"{m.__name__} imported from {m.__file__}, not {prefix}"
print(core.__file__)')"
  shift
  # ldd's output first, then grep: `ldd | grep -q` fails under pipefail when grep exits at the
  # first match and ldd, still writing, dies of SIGPIPE
  local deps
  deps="$(ldd "$so")"
  for lib in "$@"; do
    grep -q "$lib" <<< "$deps" || { echo "sanitize.sh: $so is not linked with $lib" >&2; exit 1; }
  done
}

start=$SECONDS
echo "== ASan + UBSan: build ($BUILD_DIR/asan: the C++ core, its tests, the extension) =="
make_env asan address,undefined -DPYENGINE_BUILD_TESTS=ON
check_env asan libasan libubsan
asan_built=$SECONDS

# Sanitizer reports abort the process (UBSan: -fno-sanitize-recover) with a stack trace.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
echo "== ASan + UBSan: C++ tests (ctest, leak checks on) =="
ASAN_OPTIONS="detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1" \
  ctest --test-dir "$BUILD_DIR/asan" --output-on-failure
asan_ctest=$SECONDS

echo "== ASan + UBSan: Python tests (${ASAN_TESTS[*]}) =="
# From BUILD_DIR, so that the source tree's pyengine/ is not importable from the working
# directory. --capture=sys: pytest's default (fd) capture would swallow a report written to fd 2
# by a process that then aborts. -p no:cacheprovider: leave the developer's pytest cache alone.
# Exit 5 (no tests collected) fails under set -e like any other failure.
# detect_leaks=0: CPython and torch keep allocations alive until exit (interned objects, module
# state, allocator caches) that LeakSanitizer would report on every run; the C++ tests above
# check pyengine's own code for leaks.
(cd "$BUILD_DIR" && env LD_PRELOAD="$(runtime libasan.so) $LIBSTDCXX" \
   ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=1" \
   "$BUILD_DIR/asan-venv/bin/python" -m pytest -q --capture=sys -p no:cacheprovider \
   "${ASAN_TESTS[@]/#/$REPO/}")
asan_done=$SECONDS

tsan_built=$asan_done
if [ "${TSAN_TESTS[*]}" != "skip" ]; then
  echo "== TSan: build ($BUILD_DIR/tsan: the C++ core, its tests, the extension) =="
  make_env tsan thread -DPYENGINE_BUILD_TESTS=ON
  check_env tsan libtsan
  tsan_built=$SECONDS
  echo "== TSan: C++ tests ($TSAN_CTESTS) =="
  TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" \
    ctest --test-dir "$BUILD_DIR/tsan" --output-on-failure --no-tests=error -R "$TSAN_CTESTS"
  echo "== TSan: Python tests (${TSAN_TESTS[*]}) =="
  # The CPU kernels run on one thread (OMP_NUM_THREADS, the plugin one_kernel_thread.py: gcc's
  # OpenMP runtime is not instrumented, see there), as does the tokenizers library (Rust
  # threads that synchronize in ways TSan cannot see); what TSan checks is the engine's own
  # threads. Reports abort the run (exit 66).
  (cd "$BUILD_DIR" && env LD_PRELOAD="$(runtime libtsan.so) $LIBSTDCXX" \
     TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1" OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
     PYTHONPATH="$REPO/scripts/sanitizers" \
     "$BUILD_DIR/tsan-venv/bin/python" -m pytest -q --capture=sys -p no:cacheprovider -p one_kernel_thread \
     "${TSAN_TESTS[@]/#/$REPO/}")
fi
done_at=$SECONDS

echo "== summary =="
echo "ASan+UBSan: build $((asan_built - start)) s, ctest $((asan_ctest - asan_built)) s, pytest $((asan_done - asan_ctest)) s;" \
     "TSan: build $((tsan_built - asan_done)) s, ctest + pytest $((done_at - tsan_built)) s; total $((done_at - start)) s"
echo "OK: no sanitizer findings"
