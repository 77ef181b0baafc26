#!/usr/bin/env bash
# The GPU checks of pyengine's CUDA backend in one command: build pyengine with its CUDA
# kernels, run the GPU tests, run the two GPU benchmarks.
#
#   bash bench/gpu_check.sh run       # on a machine with an NVIDIA GPU: bootstrap, build, test, benchmark
#   bash bench/gpu_check.sh prepare   # optional, on a machine with network access: download the
#                                     # wheels a GPU machine without it needs into .whl/
#                                     # (GPU_PYTHON_VERSION=3.12: for that machine's Python)
#
# `run` needs: an NVIDIA GPU and driver, the CUDA toolkit (nvcc; also looked for in
# /usr/local/cuda/bin), and a Python ($PYTHON, default python3) with a CUDA build of torch.
# Everything else it finds or installs itself:
#   0. build-only packages: the CUTLASS/CuTe headers (pip package nvidia-cutlass), and the
#      build backend (scikit-build-core, cython, cython-cmake).
#      - Fast path: if .whl/ holds wheels (made by `prepare`), they are installed from there,
#        offline, into a folder of their own ($GPU_CHECK_DEPS, default build/gpu-check-deps),
#        which is put on PYTHONPATH for this run only.
#      - The CUTLASS headers are taken from $CUTLASS_INCLUDE_DIR or an installed
#        nvidia-cutlass; if neither has them, nvidia-cutlass is pip installed (headers only,
#        no dependencies) into that same folder.
#      - If the build backend is importable, the build uses it (--no-build-isolation);
#        otherwise pip fetches it into an isolated build environment.
#   1. an editable pip install of this checkout with PYENGINE_CUDA=ON (build folder
#      build/gpu), for this GPU's architecture: compute capability 9.0 -> 90a, otherwise
#      its own (8.0 -> 80, 8.9 -> 89, ...); PYENGINE_CUDA_ARCHITECTURES overrides.
#      Without .whl/ it installs ".[test]", so pip adds any missing runtime or test
#      dependency (transformers, pytest, ...) and leaves those present as they are; with
#      .whl/ (offline) it installs "." with --no-deps, so the Python must already have them.
#   2. tests/test_cuda_build.py, tests/test_attention_workspace.py and tests/gpu/ (kernel tests
#      against PyTorch and, for the quantized linear layer, an fp64 reference; end-to-end
#      greedy equality with transformers on the GPU, CUDA graphs on/off, overlap, fp8 KV,
#      several kernels' shared-memory opt-ins in one process, fp32 / head_dim 256 engines with
#      long prefills, quantized models (at load, GGUF, AWQ/GPTQ) against dequantized references,
#      speculative decoding with its verify graphs, cuda:1 on a machine with two GPUs (skipped
#      with one), ...);
#   3. bench/attention_cuda.py (decode attention bandwidth vs the GPU's, prefill vs SDPA), and
#      bench/quant_linear_cuda.py (the weight-only quantized linear layer's bandwidth per format);
#   4. bench/gpu_throughput.py (W1 on a Qwen3-0.6B-shaped model vs transformers; see
#      bench/README.md);
#   5. bench/speculative.py --device cuda on the copying model (prompt lookup, a draft model).
# Each step runs under its own time limit (seconds; environment): GPU_CHECK_TESTS_S (all tests,
# 480), GPU_CHECK_TEST_S (one test, 120, where pytest-timeout is installed), GPU_CHECK_BENCH_S
# (each kernel benchmark, 120), GPU_CHECK_W1_S (W1, 300); GPU_CHECK_PYTEST_ARGS adds pytest options,
# GPU_CHECK_W1_ARGS replaces W1's (default --runs $W1_RUNS, 3; --quick for W1-quick),
# GPU_CHECK_QUANT_ARGS adds the quantized linear bench's (--quick); GPU_CHECK_STEPS picks the steps
# after the build (default "tests attention quant w1 speculative").
# The log (gpu_check.log), the test report
# (gpu_tests.xml) and the benchmarks' JSON go to $OUT, or ./gpu-check-out when OUT is unset.
# Exit status: the tests'; 2 when a prerequisite is missing, 3 when the build fails.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
PY="${PYTHON:-python3}"
CUTLASS_PIN="nvidia-cutlass==4.2.0.0"

case "$mode" in
  prepare)
    # The build-only packages (pure Python), and the runtime and test packages a GPU machine's
    # Python image often lacks (xgrammar and its needs, gguf, jsonschema and its needs), as
    # wheels for the GPU machine's Python: GPU_PYTHON_VERSION (default this Python's, e.g. 3.12)
    # on manylinux x86-64. cython (compiled) is not among them: that Python must have it, and
    # torch, transformers, safetensors, tokenizers, tqdm, numpy, pytest, hypothesis, attrs.
    mkdir -p .whl
    pyver="${GPU_PYTHON_VERSION:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
             manylinux2014_x86_64; do platforms+=(--platform "$p"); done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
      "${platforms[@]}" -d .whl "$CUTLASS_PIN" "cython-cmake>=0.2" "scikit-build-core>=0.10" \
      "pathspec>=0.10.1" "packaging>=23.2" xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types \
      typing-inspection "typing-extensions>=4.16" gguf jsonschema jsonschema-specifications referencing \
      rpds-py || exit 2
    ls -la .whl
    exit 0 ;;
  run) ;;
  *) echo "usage: bash bench/gpu_check.sh [run|prepare]" >&2; exit 2 ;;
esac

out="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
log="$out/gpu_check.log"
exec > >(tee "$log") 2>&1
export PYTHONUNBUFFERED=1
echo "== $(date -u) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,compute_cap --format=csv \
  || echo "warning: nvidia-smi failed"

echo "== prerequisites"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"; then
  echo "error: $PY has no CUDA build of torch; install one (https://pytorch.org) and rerun" >&2
  exit 2
fi
if [[ -z "${CUDACXX:-}" ]] && ! command -v nvcc >/dev/null; then
  if [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  else
    echo "error: no CUDA compiler: put nvcc on PATH or set CUDACXX" >&2
    exit 2
  fi
fi
echo "nvcc: $(${CUDACXX:-nvcc} --version | tail -1)"

deps="${GPU_CHECK_DEPS:-$PWD/build/gpu-check-deps}"
mkdir -p "$deps"
export PYTHONPATH="$deps${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
wheels=(.whl/*.whl)
shopt -u nullglob
if (( ${#wheels[@]} )); then
  echo "== build-only wheels from .whl/ (offline)"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$deps" "${wheels[@]}" || exit 2
  project=(--no-deps -e .)  # offline: the Python must already have the runtime and test dependencies
else
  project=(-e ".[test]")    # pip installs whatever runtime or test dependency is missing
fi

echo "== CUTLASS headers"
cutlass_dir() {  # prints the include folder of an importable nvidia-cutlass, if any
  "$PY" -c "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); \
print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include'))" 2>/dev/null
}
if [[ -n "${CUTLASS_INCLUDE_DIR:-}" && -f "$CUTLASS_INCLUDE_DIR/cute/tensor.hpp" ]]; then
  :
elif dir="$(cutlass_dir)" && [[ -f "$dir/cute/tensor.hpp" ]]; then
  export CUTLASS_INCLUDE_DIR="$dir"
else
  echo "installing $CUTLASS_PIN (headers) into $deps"
  "$PY" -m pip install -q --no-deps --no-compile --upgrade --target "$deps" "$CUTLASS_PIN" || exit 2
  dir="$(cutlass_dir)"
  [[ -f "$dir/cute/tensor.hpp" ]] || { echo "error: no cute/tensor.hpp under '$dir'" >&2; exit 2; }
  export CUTLASS_INCLUDE_DIR="$dir"
fi
echo "CUTLASS_INCLUDE_DIR=$CUTLASS_INCLUDE_DIR"

if "$PY" -c "import scikit_build_core, Cython, cython_cmake" 2>/dev/null; then
  isolation=(--no-build-isolation)
  echo "build backend: importable (no build isolation)"
else
  isolation=()
  echo "build backend: not importable; pip fetches it into an isolated build environment"
  (( ${#wheels[@]} )) && echo "warning: that needs network access; offline, install cython in $PY first"
fi

arch="${PYENGINE_CUDA_ARCHITECTURES:-}"
if [[ -z "$arch" ]]; then
  cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
  case "$cap" in
    90) arch=90a ;;
    [0-9][0-9]|[0-9][0-9][0-9]) arch="$cap" ;;
    *) arch=90a; echo "warning: compute capability unknown; building for sm_90a" ;;
  esac
fi

echo "== build (CUDA ON, architectures $arch)"
start=$(date +%s)
# Editable: the tests run from the source tree and import the built extension.
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install -q ${isolation[@]+"${isolation[@]}"} "${project[@]}" \
  -C build-dir=build/gpu -C cmake.define.PYENGINE_CUDA=ON \
  -C cmake.define.PYENGINE_CUDA_ARCHITECTURES="$arch" || exit 3
echo "build: $(( $(date +%s) - start )) s"
"$PY" -c "import pyengine.core._core as c; print('CUDA kernels built:', c._cuda_kernels_built(), c._cuda_architectures())" \
  || exit 3

steps=" ${GPU_CHECK_STEPS:-tests attention quant w1 speculative} "
wants() { [[ "$steps" == *" $1 "* ]]; }
tests_rc=0

if wants tests; then
  echo "== tests"
  # a hung test must not take the whole run: a limit per test where pytest-timeout is installed
  per_test=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "${GPU_CHECK_TEST_S:-120}")
  timeout "${GPU_CHECK_TESTS_S:-480}" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_build.py \
    tests/test_attention_workspace.py tests/gpu ${per_test[@]+"${per_test[@]}"} ${GPU_CHECK_PYTEST_ARGS:-} \
    --junitxml="$out/gpu_tests.xml"
  tests_rc=$?
  echo "tests exit status: $tests_rc"
fi

if wants attention; then
  echo "== decode / prefill attention kernels"
  timeout "${GPU_CHECK_BENCH_S:-120}" "$PY" bench/attention_cuda.py --json "$out/attention_cuda.json" \
    || echo "attention bench failed: $?"
fi

if wants quant; then
  echo "== weight-only quantized linear layer"
  timeout "${GPU_CHECK_BENCH_S:-120}" "$PY" bench/quant_linear_cuda.py --iters 10 ${GPU_CHECK_QUANT_ARGS:-} \
    --json "$out/quant_linear_cuda.json" || echo "quantized linear bench failed: $?"
fi

if wants w1; then
  echo "== W1 on a Qwen3-0.6B-shaped model"
  timeout "${GPU_CHECK_W1_S:-300}" "$PY" bench/gpu_throughput.py ${GPU_CHECK_W1_ARGS:---runs ${W1_RUNS:-3}} \
    --json "$out/gpu_throughput.json" || echo "W1 bench failed: $?"
fi

if wants speculative; then
  echo "== speculative decoding at batch 1 (copying-135m-shape: prompt lookup, then a 2-layer draft model)"
  timeout "${GPU_CHECK_BENCH_S:-120}" "$PY" bench/speculative.py --device cuda --model copying --runs 3 \
    || echo "speculative bench (ngram) failed: $?"
  timeout "${GPU_CHECK_BENCH_S:-120}" "$PY" bench/speculative.py --device cuda --model copying --runs 3 \
    --method draft_model --draft-layers 2 || echo "speculative bench (draft model) failed: $?"
fi
echo "== done $(date -u)"
exit $tests_rc
