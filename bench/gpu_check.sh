#!/usr/bin/env bash
# The GPU checks of the CUDA backend, in one run (issue 7's acceptance 2).
#
#   bash bench/gpu_check.sh prepare   # here, with network: the wheels the GPU machine lacks -> .whl/
#   bash bench/gpu_check.sh run       # on the GPU machine (no network): build, test, benchmark
#
# With this workplace's device tool: run(command="bash bench/gpu_check.sh run", carry=[".whl"],
# timeout_s=540); the logs come back from $OUT.
# `run` builds pyengine with its CUDA kernels for this GPU (sm_90a unless
# PYENGINE_CUDA_ARCHITECTURES says otherwise), then runs, each under its own time limit:
#   1. tests/test_cuda_build.py and tests/gpu/ (kernel tests against PyTorch, end-to-end
#      greedy equality with transformers on the GPU, graphs on/off, overlap, fp8 KV, ...);
#   2. bench/attention_cuda.py (decode attention bandwidth vs the GPU's, prefill vs SDPA);
#   3. bench/gpu_throughput.py (W1 on a Qwen3-0.6B-shaped model vs transformers).
# Logs and JSON go to $OUT (or ./gpu-check-out). The exit status is the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-run}"
PY="${PYTHON:-python3}"

if [[ "$mode" == prepare ]]; then
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  mkdir -p .whl
  # The GPU machine has Python 3.12, torch, transformers, cython and scikit-build-core; not these.
  "$PY" -m pip download -q --no-deps -d .whl "nvidia-cutlass==4.2.0.0" "cython-cmake>=0.2"
  ls -la .whl
  exit 0
fi

out="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$out"
log="$out/gpu_check.log"
exec > >(tee "$log") 2>&1
export PYTHONUNBUFFERED=1
echo "== $(date -u) on $(hostname)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true

echo "== carried wheels"
"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export CUTLASS_INCLUDE_DIR=/tmp/site/cutlass_library/source/include

echo "== build (CUDA ON)"
start=$(date +%s)
# Editable, as in development: tests run from the source tree and import the built extension.
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install -q --no-build-isolation --no-deps -e . \
  -C build-dir=build/gpu -C cmake.define.PYENGINE_CUDA=ON \
  -C cmake.define.PYENGINE_CUDA_ARCHITECTURES="${PYENGINE_CUDA_ARCHITECTURES:-90a}" || exit 3
echo "build: $(( $(date +%s) - start )) s"
"$PY" -c "import pyengine.core._core as c; print('CUDA kernels built:', c._cuda_kernels_built(), c._cuda_architectures())" \
  || exit 3

echo "== tests"
timeout 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda_build.py tests/gpu \
  --junitxml="$out/gpu_tests.xml"
tests_rc=$?
echo "tests exit status: $tests_rc"

echo "== decode / prefill attention kernels"
timeout 120 "$PY" bench/attention_cuda.py --json "$out/attention_cuda.json" || echo "attention bench failed: $?"

echo "== W1 on a Qwen3-0.6B-shaped model"
timeout 300 "$PY" bench/gpu_throughput.py --runs "${W1_RUNS:-3}" --json "$out/gpu_throughput.json" \
  || echo "W1 bench failed: $?"
echo "== done $(date -u)"
exit $tests_rc
